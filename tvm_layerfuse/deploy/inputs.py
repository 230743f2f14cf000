"""What ``deploy`` is given, checked before anything is sent: the board's address, the inputs,
the artifact's library against its manifest, the device and the board's machine."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from ..errors import ArtifactError, BoardMismatchError, UsageError
from ..runtime.loader import Inputs, check_inputs, compiled_for, contiguous, parse_device

Address = Union[str, Sequence[Any]]

# ELF e_machine -> the machine names the manifests use (runtime.this_machine spelling).
_ELF_MACHINES = {
    0x03: "i386",
    0x08: "mips",
    0x14: "ppc",
    0x15: "ppc64",
    0x28: "armv7l",
    0x3E: "x86_64",
    0xB7: "aarch64",
    0xF3: "riscv64",
}



def parse_address(value: Address, *, what: str = "--rpc") -> tuple[str, int]:
    """``"host:port"``, ``"[::1]:port"`` or ``(host, port)`` -> ``(host, port)``."""
    if isinstance(value, str):
        host, sep, port = value.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not sep or not host:
            raise UsageError(f"{what} {value!r} is malformed; expected HOST:PORT, e.g. 127.0.0.1:9091")
    else:
        try:
            host, port = value
        except (TypeError, ValueError):
            raise UsageError(f"{what} {value!r} is malformed; expected (host, port)") from None
    try:
        port_no = int(port)
    except (TypeError, ValueError):
        raise UsageError(f"{what} {value!r} has a non-integer port; expected HOST:PORT, e.g. 127.0.0.1:9091") from None
    if not 0 < port_no < 65536:
        raise UsageError(f"{what} {value!r} has port {port_no}; expected 1..65535")
    return str(host), port_no


def normalize_inputs(manifest: Mapping[str, Any], inputs: Inputs) -> list[np.ndarray]:
    """Inputs in manifest order, checked by name, shape and dtype (the runtime's own rules)."""
    return [contiguous(v) for v in check_inputs(manifest["inputs"], inputs)]


def elf_machine(head: bytes) -> Optional[str]:
    """Machine of an ELF file from its first 20 bytes (None when it is not ELF)."""
    if len(head) < 20 or head[:4] != b"\x7fELF":
        return None
    order = "<" if head[5] == 1 else ">"
    (code,) = struct.unpack(order + "H", head[18:20])
    name = _ELF_MACHINES.get(code, f"elf-machine-{code:#x}")
    if code == 0xF3 and head[4] == 1:
        name = "riscv32"
    return name


def check_library(path: Path, manifest: Mapping[str, Any]) -> None:
    """The library must be for the machine the manifest names (else the manifest lies)."""
    expected = manifest["target"].get("machine")
    with open(path / manifest["library"], "rb") as f:
        found = elf_machine(f.read(20))
    if expected and found and found != expected:
        raise ArtifactError(
            f"library {manifest['library']!r} of artifact {str(path)!r} is {found} code, but the manifest says "
            f"{expected}; the artifact was edited or mixed up - re-run `compile`"
        )
    for entry in (manifest.get("tactics") or {}).get("libraries") or []:
        name = entry.get("file") if isinstance(entry, dict) else None
        if not isinstance(name, str) or name not in manifest.get("files", {}):
            raise ArtifactError(
                f"manifest of {str(path)!r} has a tactic library entry {str(entry)[:80]} that names no file of the artifact; "
                "re-run `compile`"
            )


def tactic_entries(path: Path, manifest: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The tactic libraries a board loads before the model: file, checksum, what they need."""
    return [
        {"file": e["file"], "sha256": manifest["files"][e["file"]], "needs": list(e.get("needs") or []), "install": e.get("install")}
        for e in (manifest.get("tactics") or {}).get("libraries") or []
    ]


def vendor_uploads(path: Path, manifest: Mapping[str, Any]) -> dict[str, str]:
    """``deploy --upload-onednn``: this machine's copy of each vendor library the artifact's
    tactic libraries need (soname -> path); raises ArtifactError when one is not here."""
    from ..runtime.tactics import vendor_file

    found: dict[str, str] = {}
    for entry in tactic_entries(path, manifest):
        for soname in entry["needs"]:
            where = vendor_file(soname, Path(path) / entry["file"])
            if where is None:
                raise ArtifactError(
                    f"--upload-onednn: {soname} is not installed on this machine; install it ({entry['install']}) and deploy again"
                )
            found[soname] = str(where)
    if not found:
        raise UsageError(f"--upload-onednn: artifact {str(path)!r} runs no layer on oneDNN; nothing to upload - leave the option out")
    return found


def fit_board(manifest: Mapping[str, Any], *, board: str, machine: Optional[str]) -> None:
    """Refuse an artifact whose machine is not the board's (before anything is uploaded)."""
    target = manifest["target"]
    wanted = target.get("machine")
    if machine is None or not wanted or machine == wanted:
        return
    preset = {"aarch64": "aarch64", "x86_64": "cpu"}.get(machine) if target.get("device") != "vta" else None
    raise BoardMismatchError(
        f"artifact was compiled for {wanted} (target {target.get('preset')}), but board {board} runs {machine}; "
        f"nothing was uploaded - "
        + (
            f"compile with --target {preset} for this board"
            if preset
            else f"compile with a {'VTA ' if target.get('device') == 'vta' else ''}target preset for {machine}"
        )
        + f", or deploy to {'an' if wanted[:1] in 'aeiox' else 'a'} {wanted} board"
    )


def check_device(manifest: Mapping[str, Any], device: str) -> None:
    kind, _ = parse_device(device)
    target = manifest["target"]
    if target.get("device") != kind:
        raise BoardMismatchError(
            f"artifact was compiled for {compiled_for(target)}, but --device {device} was requested; "
            f"deploy it with --device {target.get('device')} or compile for {kind}"
        )
