"""The HTTP gateway: validates, annotates and enqueues; never imports a runtime."""
