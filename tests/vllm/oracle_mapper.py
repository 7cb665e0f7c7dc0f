"""Run in the oracle venv: vLLM's own FileMapper paths for the configs given as JSON on stdin (one per line out)."""

from __future__ import annotations

import json
import sys

from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.kv_offload.file_mapper import FileMapper


def main() -> None:
    out = []
    for case in json.load(sys.stdin):
        kw = dict(case["mapper"])
        mapper = FileMapper(root_dir="/root", **kw)
        paths = [mapper.get_file_name(make_offload_key(bytes.fromhex(h), g)) for h, g in case["blocks"]]
        out.append({"paths": paths, "config": mapper.get_config_file_path(), "fields": mapper.get_run_config()})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
