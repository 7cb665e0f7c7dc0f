"""The routes: headers, path and body <-> service calls, and nothing else (auth and limits wrap them)."""
