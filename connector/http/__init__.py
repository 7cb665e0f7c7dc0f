"""The gateway's client: ``BlockClient`` over two transports (the lean HTTP/1.1 pool for block PUTs and GETs,
aiohttp for the rest), its byte budget and stats, TLS, checksums and errors. Imports nothing of the other wings."""
