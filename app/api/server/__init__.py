"""The server: uvicorn protocol pieces (head bounds, zero-copy bodies, the peer certificate), TLS, the runner."""
