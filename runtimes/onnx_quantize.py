"""int8 dynamic quantisation of an ONNX encoder that keeps its vectors close to float32.

ONNX Runtime's dynamic quantisation gives each activation one uint8 scale per tensor, computed at
run time. Transformer activations have a few outlier channels (tens of times the median) that set
that scale and crush every other channel: quantised as it is, all-MiniLM-L6-v2 drifts to a cosine
of about 0.978 against float32. Two things make it hold (about 0.996 on the same text):

- SmoothQuant (Xiao et al., 2023): divide each input channel of a matrix product's activation by
  s = sqrt(max|x| / max|w|) and multiply the matching weight row by s. The product is unchanged,
  the outliers move into the weights, which are quantised per channel. `max|x|` is measured once,
  on a few sentences, when the model is exported.
- The products fed by a GELU keep float32 weights: their inputs are long-tailed and one-sided, and
  no smoothing makes one uint8 scale fit them.

Weights are int8 where the CPU has VNNI, uint8 elsewhere (`weight_kind`). Without VNNI (an x86 CPU with AVX2
only: the AMD EPYC of the 2026-12-01 VM) ONNX Runtime's uint8 x int8 kernel sums pairs of products in 16 bits,
which saturate: all-MiniLM-L6-v2 fell to a cosine of 0.987 there, and the export's check refused it (7-bit weights,
ORT's `reduce_range`, reached 0.995 but put a random token classifier's logits 10.5% off). Its uint8 x uint8
kernel widens first: 0.995, and 4.7% on that classifier. With VNNI, int8 weights take its faster instructions.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from functools import cache
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

_GELU_OPS = frozenset({"Gelu", "BiasGelu", "FastGelu", "QuickGelu"})


@cache
def weight_kind() -> str:
    """ "s8" (int8 weights) on a CPU with VNNI, else "u8": which one an int8 export on this machine makes (read once:
    the cache key and the quantiser both ask)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: the kind that saturates nowhere
        return "u8"
    return "s8" if any(flag in flags for flag in (" avx512_vnni", " avx_vnni", " amx_int8")) else "u8"


def quantize_int8(path: Path, out: Path, calibration: Mapping[str, np.ndarray]) -> Path:
    """Smooth, then dynamically quantise the matrix products of `path` into `out`, weights of `weight_kind`.

    `calibration` is one batch of real inputs by graph input name (attention mask included).
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(path))
    _drop_initializer_shapes(model)
    products, after_gelu = _matrix_products(model)
    peaks = _activation_peaks(model, [node.input[0] for node in products], calibration)
    _smooth(model, products, peaks)
    with tempfile.TemporaryDirectory(dir=out.parent) as work:
        smoothed = Path(work) / "smoothed.onnx"
        onnx.save(model, str(smoothed))
        quantize_dynamic(
            smoothed,
            out,
            op_types_to_quantize=["MatMul"],
            per_channel=True,
            weight_type=QuantType.QInt8 if weight_kind() == "s8" else QuantType.QUInt8,
            nodes_to_exclude=after_gelu,
        )
    return out


def _drop_initializer_shapes(model: onnx.ModelProto) -> None:
    """Forget the shapes the exporter wrote down for constants: a constant's shape is its own.

    ONNX Runtime's quantiser re-infers shapes and refuses a graph where such an entry disagrees with
    what it infers; the torch exporter's entry for a classification head's Gemm weight does (3 labels
    against 32 channels), so no sequence-classification model could be quantised.
    """
    constants = {init.name for init in model.graph.initializer}
    kept = [info for info in model.graph.value_info if info.name not in constants]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept)


def _matrix_products(model: onnx.ModelProto) -> tuple[list[onnx.NodeProto], list[str]]:
    """MatMuls with a constant 2-D weight: those to smooth and quantise, and the names of those to skip."""
    weights = {init.name: init for init in model.graph.initializer if len(init.dims) == 2}
    producers = {output: node.op_type for node in model.graph.node for output in node.output}
    quantised, skipped = [], []
    for node in model.graph.node:
        if node.op_type != "MatMul" or node.input[1] not in weights:
            continue
        if producers.get(node.input[0]) in _GELU_OPS:
            skipped.append(node.name)
        else:
            quantised.append(node)
    return quantised, skipped


def _activation_peaks(
    model: onnx.ModelProto, names: list[str], calibration: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """max |x| per channel of each named activation, over the real (unmasked) tokens of one batch."""
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for name in dict.fromkeys(names):
        probe.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    wanted = list(dict.fromkeys(names))
    feeds = {arg.name: calibration[arg.name] for arg in session.get_inputs()}
    real = calibration["attention_mask"] > 0
    values = session.run(wanted, feeds)
    return {name: np.abs(value[real]).max(axis=0) for name, value in zip(wanted, values, strict=True)}


def _smooth(model: onnx.ModelProto, products: list[onnx.NodeProto], peaks: Mapping[str, np.ndarray]) -> None:
    """x @ W == (x / s) @ (s W): fold s into each weight's rows, divide its input by s in a Mul node."""
    weights = {init.name: init for init in model.graph.initializer}
    divisions = {}
    for node in products:
        weight = numpy_helper.to_array(weights[node.input[1]])
        activation_peak = np.maximum(peaks[node.input[0]], 1e-5)
        scale = np.sqrt(activation_peak / np.maximum(np.abs(weight).max(axis=1), 1e-5)).astype(np.float32)
        weights[node.input[1]].CopyFrom(numpy_helper.from_array(weight * scale[:, None], node.input[1]))
        inverse = f"{node.name}_smooth_scale"
        model.graph.initializer.append(numpy_helper.from_array((1.0 / scale).astype(np.float32), inverse))
        smoothed = f"{node.input[0]}_smoothed_for_{node.name}"
        divisions[node.name] = helper.make_node("Mul", [node.input[0], inverse], [smoothed], name=f"{node.name}_smooth")
        node.input[0] = smoothed
    # Repeated protobuf fields have no insert: rebuild the node list with each Mul before its product.
    nodes = []
    for node in model.graph.node:
        if node.name in divisions:
            nodes.append(divisions[node.name])
        nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
