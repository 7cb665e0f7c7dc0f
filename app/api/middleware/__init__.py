"""Pure-ASGI layers around the routes: auth (deny by default), limits on bodies and uploads, metrics."""
