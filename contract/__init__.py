"""What both halves of kvgate share, and nothing else: the key contract (vLLM FileMapper names and the namespace
digest, ``contract.keys``) and the wire grammar of kvgate's headers (``contract.wire``). Standard library only:
``app`` (the gateway) and ``connector`` (the vLLM side) both stand on it, and on nothing of each other."""
