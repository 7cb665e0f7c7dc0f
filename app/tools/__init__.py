"""Operator tools: the kvgate CLI, import, the load generator. They use the rest of app; nothing in app uses them."""
