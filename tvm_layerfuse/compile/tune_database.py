"""Where the tuning records of a target live (written by ``tune``, applied by ``compile``).

One JSON database (MetaSchedule's ``database_workload.json`` + ``database_tuning_record.json``)
per resolved target, ``-mcpu`` included, under ``$TVM_LAYERFUSE_CACHE/tune`` (default
``~/.cache/tvm_layerfuse/tune``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional


def database_dir(target_dict: Mapping[str, Any], host: Optional[Mapping[str, Any]] = None) -> Path:
    """The tuning database of a target: one folder per resolved target (mcpu included)."""
    key = json.dumps({"target": target_dict, "host": host}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    root = Path(os.environ.get("TVM_LAYERFUSE_CACHE", Path.home() / ".cache" / "tvm_layerfuse"))
    kind = str(target_dict.get("kind", "target"))
    mcpu = str(target_dict.get("mcpu") or target_dict.get("arch") or "")
    return root / "tune" / f"{kind}{'-' + mcpu if mcpu else ''}-{digest}"


def has_database(path: Path) -> bool:
    records = path / "database_tuning_record.json"
    return records.is_file() and records.stat().st_size > 0


def applied_database(target_dict: Mapping[str, Any], host: Optional[Mapping[str, Any]] = None, *, fuse: bool = True) -> Optional[Path]:
    """The database ``compile`` applies for this target (the fused pipeline only), or None."""
    path = database_dir(target_dict, host)
    return path if fuse and has_database(path) else None


def summary(path: Optional[Path]) -> Optional[dict[str, Any]]:
    """What the manifest records of an applied database: where it is, its records and kernels."""
    if path is None:
        return None
    lines = [line for line in (path / "database_tuning_record.json").read_text().splitlines() if line.strip()]
    workloads = {json.loads(line)[0] for line in lines}
    return {"database": str(path), "records": len(lines), "workloads": len(workloads)}
