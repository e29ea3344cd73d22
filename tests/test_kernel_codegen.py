"""What the compiler made of the CPU kernels: properties the bit tests cannot see.

GCC once deleted every software prefetch of the tile kernels without a warning: `prefetch_block`, a
function of its own that only prefetches, was found free of side effects, marked const and its calls
dropped. Results stay bit-identical, so only the disassembly (or a 1.6-2x slower 8-row product of cold
weights) shows it.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from ssd.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason=str(cpu.unavailable_reason()))


def _functions(lib_path: str) -> dict[str, str]:
    """Demangled function name -> its disassembly, for every function in the library."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) not found")
    text = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", lib_path], check=True,
                          capture_output=True, text=True).stdout
    funcs: dict[str, str] = {}
    for chunk in re.split(r"\n(?=[0-9a-f]+ <)", text):
        head = re.match(r"[0-9a-f]+ <(.+)>:", chunk)
        if head:
            funcs[head.group(1)] = chunk
    return funcs


@pytest.mark.parametrize("isa_name", cpu.supported_isas())
def test_tile_kernels_keep_their_software_prefetches(isa_name: str) -> None:
    funcs = _functions(str(cpu._build(isa_name)))
    tiles = {name: body for name, body in funcs.items() if re.search(r"\btile2?_dot<", name)}
    assert tiles, f"no tile kernels found in the {isa_name} build (renamed? update this test)"
    # Both distances: far ahead into L2 (prefetcht1), near ahead into L1 (prefetcht0).
    for hint in ("prefetcht1", "prefetcht0"):
        without = sorted(name for name, body in tiles.items() if hint not in body)
        assert not without, f"{isa_name} build: tile kernels without a {hint} instruction: {without}"
