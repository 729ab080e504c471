"""What stops a box from starting with these settings, checked by `fleetbox serve` before anything starts.

Each check returns the one line that says why (or None): the box binds its ports only after starting NATS and
loading its models, so a problem found there was a bare log line and exit 1, once the models had loaded.
"""

from __future__ import annotations

import ipaddress
import socket

from appliance.settings import Settings


def replicas_problem(settings: Settings) -> str | None:
    """The embedded server is one server: a stream of more replicas was refused (the box exited saying `ServerError()`,
    auditor h61). Judged by `serve` only: `tune` reads the same config file and runs no NATS."""
    if settings.replicas == 1:
        return None
    return (
        f"replicas: {settings.replicas} needs a NATS cluster of at least that many servers; the embedded server is "
        "one: join a cluster with --nats, or leave replicas at 1"
    )


def ports_problem(settings: Settings) -> str | None:
    """The HTTP port and the embedded server's are two: one for both read `port P is in use` (by its own server,
    started first: tester h73)."""
    if settings.port != settings.nats_port:
        return None
    return (
        f"port: {settings.port} is also the embedded nats-server's port (nats_port); give the HTTP port and"
        " --nats-port different ports"
    )


def device_problem(device: str) -> str | None:
    """Why torch cannot run on `device` here (`cuda` on a machine without one), or None."""
    if not device.startswith("cuda"):
        return None
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.partition(":")[2] or 0)
    if count == 0:
        built = "" if torch.version.cuda else f" (torch {torch.__version__} is built without CUDA)"
        return f"device: {device}: torch sees no CUDA device on this machine{built}"
    if index >= count:
        devices = f"{count} CUDA device{'s' if count > 1 else ''}"
        return f"device: {device}: torch sees {devices} on this machine (cuda:0 to cuda:{count - 1})"
    return None


def host_problem(field: str, host: str) -> str | None:
    """Why a box cannot listen on `host` (a name that does not resolve, an address this machine lacks), or None.

    Checked before anything starts: the box binds its HTTP port only after starting NATS and loading its
    models, and failed there with a bare `gaierror` log line and exit 1."""
    try:
        addresses = socket.getaddrinfo(host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        return f"{field}: {host!r} does not resolve to an address ({getattr(exc, 'strerror', None) or exc})"
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            try:
                sock.bind(address)  # port 0: only whether this machine has the address, not whether a port is free
            except OSError as exc:
                return f"{field}: cannot listen on {host!r}: {exc.strerror or exc}"
    return None


def port_problem(host: str, port: int) -> str | None:
    """'port P on H is in use' when another process listens there (checked before a box starts,
    which binds its HTTP port only after loading its models); None when it is free or any port."""
    from appliance.natsd import port_in_use

    if port == 0:
        return None
    try:
        return f"port {port} on {host} is in use" if port_in_use(host, port) else None
    except OSError:
        return None  # not this check's business: the box's own bind reports it


def nats_port_problem(settings: Settings) -> str | None:
    """Why the embedded nats-server cannot listen on its port (another process does); None when it can, or when
    the box joins a server (`--nats`). Checked before the start, as the HTTP port is: the refusal was a JSON log
    line carrying an `OSError(98, ...)` repr."""
    from appliance.natsd import NatsPortInUse, check_port_free

    if settings.nats_urls:
        return None
    try:
        check_port_free(settings.nats_host, settings.nats_port)
    except NatsPortInUse as exc:
        return exc.strerror
    except OSError:
        return None  # not this check's business: the server's own start reports it
    return None


def open_routes_warnings(settings: Settings) -> list[str]:
    """What a box's keys leave open that its operator may not mean to: said at start (tester h191: a box with API keys
    alone looked locked down; the Docker image listens on every address with no key at all)."""
    if not settings.serves_http:
        return []
    if settings.api_key_list and not settings.admin_key_list:
        return [
            "FBX_API_KEYS is set and FBX_ADMIN_KEYS is not: every API key may also register, change, delete, pin, "
            "load and evict models; set FBX_ADMIN_KEYS to keep those to operators"
        ]
    if not settings.api_key_list and not settings.admin_key_list and not _loopback(settings.host):
        return [
            f"no FBX_API_KEYS or FBX_ADMIN_KEYS: every route, admin included, is open to whoever reaches "
            f"{settings.host}:{settings.port}; see docs/security.md"
        ]
    return []


def _loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any address
