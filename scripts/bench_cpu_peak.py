"""The arithmetic peak of one core of this CPU for the instructions the C++ kernels multiply with: a loop of 15
independent chains of one instruction on registers (no memory), timed, so a kernel's FLOP rate can be read as a
share of what the core can do at all. The matmul kernel's products and the LM head are compute-bound at 64 rows
(scripts/KERNELS.md): their floor is their FLOPs at this rate times the cores.

  python scripts/bench_cpu_peak.py            # vdpbf16ps where the CPU has AVX-512-BF16, FMAs of 8 and 16 floats
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jpaged.pallas.cpu.library import cpu_flags  # noqa: E402

# (name, the instruction on zmm0/ymm0 into register {r}, the flag it needs, FLOPs per instruction)
INSTRUCTIONS = (
    ("vdpbf16ps zmm (bfloat16 pairs)", "vdpbf16ps %%zmm0, %%zmm0, %%zmm{r}", "avx512_bf16", 64),
    ("vfmadd231ps zmm (16 floats)", "vfmadd231ps %%zmm0, %%zmm0, %%zmm{r}", "avx512f", 32),
    ("vfmadd231ps ymm (8 floats)", "vfmadd231ps %%ymm0, %%ymm0, %%ymm{r}", "avx2", 16),
)
# registers 1..15, fifteen independent accumulators (register 0 is the source): AVX2 has no register 16, and 15
# chains outrun the latency of each instruction here at its throughput
CHAINS = range(1, 16)
ITERATIONS = 100_000_000

PROGRAM = r"""
#include <chrono>
#include <cstdio>
int main() {
  auto start = std::chrono::steady_clock::now();
  asm volatile("mov %0, %%rcx\n1:\n" BODY "dec %%rcx\njnz 1b\n" :: "r"(ITERATIONSL) : "rcx", CLOBBERS);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%.4f\n", s);
}
"""


def seconds(instruction: str, workdir: Path) -> float:
    """Wall time of ITERATIONS x len(CHAINS) of `instruction`, one chain per register."""
    body = "".join(f'"{instruction.format(r=r)}\\n"' for r in CHAINS)
    clobbers = ", ".join(f'"xmm{r}"' for r in CHAINS)
    source = workdir / "peak.cc"
    program = PROGRAM.replace("BODY", body).replace("CLOBBERS", clobbers)
    source.write_text(program.replace("ITERATIONS", str(ITERATIONS)))
    binary = workdir / "peak"
    subprocess.run(["g++", "-O2", "-march=native", str(source), "-o", str(binary)], check=True)
    return float(subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout)


def main() -> None:
    flags = cpu_flags()
    print("| instruction | G instructions/s per core | GFLOP/s per core |")
    print("|---|---|---|")
    with tempfile.TemporaryDirectory() as workdir:
        for name, instruction, flag, flops in INSTRUCTIONS:
            if flag not in flags:
                print(f"| {name} | not on this CPU ({flag}) | |")
                continue
            rate = ITERATIONS * len(CHAINS) / seconds(instruction, Path(workdir))
            print(f"| {name} | {rate / 1e9:.2f} | {rate * flops / 1e9:.0f} |")
    print("\ncommand: python scripts/bench_cpu_peak.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
