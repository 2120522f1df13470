"""Fused C++ kernels for the CPU hot path: loads them (JIT-built on first use) and dispatches.

The C++ lives in csrc/ at the repository root, one file per operation: attention.cpp (paged
attention), cache.cpp (KV writes), norm.cpp (RMSNorm, residual add + RMSNorm), elementwise.cpp
(rotary, SiLU-and-multiply), argmax.cpp, gemm.cpp (bf16 linears), fused_layer.cpp (a decoder layer
in one call), chains.cpp (a step's drafting passes in one call), common.h (vector helpers),
amx_tiles.h / amx_emulation.h (the AMX tile operations, in hardware or, in the build
`build_emulated_amx` makes, in software) and bindings.cpp (the Python module).

Owns: building / loading that module (`load`, `build`), the backend choice (``PHALANX_KERNELS``),
`decode_attention` (the paged attention's decode group and prefill chunks), `argmax` (greedy tokens
from the logits), `gemm_isa` (which GEMM path bf16 linears take, ``PHALANX_CPU_ISA``; used by
``layers.linear.PackedLinear``), `cpu_flags` (the CPU's feature flags from /proc/cpuinfo, which
also tag the build) and `attach` (hands the module to the layers that use the
elementwise ops: RMSNorm, residual add + RMSNorm, rotary, SiLU-and-multiply). The one-call layer
(``models.llama.DecoderLayer``) and the drafting chains (``models.eagle``, ``models.llama.CausalLM``
as a draft model) call the module directly.
Does not own: the reference implementations (``attention.torch_paged``, ``layers.*``), which every
result of these kernels is tested against and which serve whenever the kernels are off.

Why. In eager PyTorch every small op costs a fixed ~5-30 us on this CPU, and a decoder layer is
~40 of them: at batch 1 those fixed costs, not arithmetic, are most of a step. The reference decode
attention gathers every request's K/V blocks into a contiguous copy per layer and runs two bf16
batched matmuls, a mask and a softmax (profiles of the c = 16 serving workload put that path on par
with all the linear layers together); `torch.rms_norm` on CPU is ~8 ops (plus the residual add before
it), rotary ~6. The kernels do each of those in one call. The SiLU-and-multiply of the
gated MLP is one vectorised pass (the earlier scalar attempt lost to PyTorch's two vectorised ops;
this one is ~10-20 % faster than them and equal to the last bit on every tested input), and
`argmax` over the logits reads bf16 in place (torch's last-dim argmax is scalar here: 957 -> 138 us
for 32 x 32000).

decode_attention reads the keys and values straight from the paged cache through the block table,
once per (request, KV head) for all of its query heads and query tokens, with AVX512-BF16 dot
products (bf16 with head_dim 32-128: 16 keys per step and one transpose-and-add tree for their 16
sums, then the values streamed past register-held accumulators of up to 4 query rows; 2-2.6x
faster than one horizontal reduction and one accumulator round trip per key), float32 scores,
softmax and accumulation, the output rounded once (the reference rounds
scores and probabilities to the activation dtype in between). Each query's result depends only on
its own query, keys and values, never on the batch or on how many query tokens its request has
(every reduction runs in a fixed order): the kernel is batch-invariant. bf16 and float32.

The elementwise ops are bf16 only (the fast path; float32 models stay on the reference ops, whose
numerics the Hugging Face parity tests pin) and round exactly where the PyTorch ops they replace
round (norm: float32 normalisation, round, times the bf16 weight, round; add: one rounding; rotary:
both products, then the sum), so they agree with the reference to the last bit (rotary, the add)
or except where the float32 reduction order flips a rounding (the norm, one bf16 ulp, rarely).

Backends (``PHALANX_KERNELS``): ``auto`` (default) uses the kernels when they build (a C++
compiler and ninja, both present after ``make install``) and falls back to the reference with one
warning otherwise; ``torch`` always uses the reference; ``cpp`` requires the kernels (an error if
they cannot be built). `main` builds them ahead of time (``make install`` runs it), so the first
server start does not pay the ~1 min compile; the build is cached in ``PHALANX_KERNEL_CACHE``
(default ``~/.cache/phalanx/kernels``), one folder per torch version, CPU feature set and source
hash, and a finished build is imported straight from its folder (`_import_built`). The choice for
the elementwise ops is made once, when a model is loaded (`attach`); the decode attention checks it
per forward.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "cpp")


_lock = threading.Lock()
_module: Any = None
_failed: str | None = None
SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)


def backend() -> str:
    value = os.environ.get("PHALANX_KERNELS", "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"PHALANX_KERNELS={value!r} is not valid; valid: {', '.join(BACKENDS)}")
    return value


CSRC = Path(__file__).resolve().parents[2] / "csrc"  # the kernels' C++ sources, at the repository root
# One translation unit per operation (csrc/*.cpp), built into one module; bindings.cpp registers them.
SOURCES = ("attention.cpp", "cache.cpp", "norm.cpp", "elementwise.cpp", "argmax.cpp", "gemm.cpp",
           "fused_layer.cpp", "chains.cpp", "bindings.cpp")
FUNCTIONS = (
    "decode_attention", "decode_attention_f32", "rms_norm", "add_rms_norm", "rotary", "silu_mul", "argmax_rows", "cache_write",
    "pack_pairs", "gemm", "gemm_isas", "fused_layer",
    "eagle_chain", "model_chain",
)
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")  # no FMA contraction: each op rounds as written
STALE_LOCK_S = 600.0  # a build takes ~30-60 s here; a lock this old was left by a killed build


def source_paths() -> list[Path]:
    """The C++ sources, checked: a clear error when the csrc/ folder is not beside the package (a
    non-editable install copies only the Python package)."""
    paths = [CSRC / name for name in SOURCES]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"phalanx's C++ kernel sources are missing ({', '.join(missing)}): they live in csrc/ at the "
            f"repository root, next to the phalanx package; install from a checkout with `pip install -e .`"
        )
    return paths


@functools.cache
def _flags_line() -> str | None:
    """The first processor's ``flags`` line of /proc/cpuinfo ("" without one, None where the file
    cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return None


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty where /proc/cpuinfo has none)."""
    line = _flags_line() or ""
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def _cpu_tag() -> str:
    """A short hash of the CPU's feature flags: the build uses -march=native, so a cache shared
    between different machines (a network home) must not hand one CPU another's binary."""
    flags = _flags_line()
    if flags is None:
        import platform

        flags = platform.processor() or platform.machine()
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def _source_tag() -> str:
    """A short hash of the sources' folder and of every C++ source and header in it: a changed kernel
    gets its own build folder, and so does another checkout (torch's build file names the sources by
    path: two checkouts sharing a folder would rebuild it in turn)."""
    digest = hashlib.sha1(str(CSRC).encode())
    for path in sorted(CSRC.glob("*.[ch]*")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:10]


def build_dir(variant: str = "") -> Path:
    """The build folder: torch's version, the CPU's flags and the sources' hash (`variant` names a
    non-default build, e.g. a portable -march)."""
    root = os.environ.get("PHALANX_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "phalanx", "kernels"
    )
    name = f"torch-{torch.__version__}-flags-{_cpu_tag()}-src-{_source_tag()}" + (f"-{variant}" if variant else "")
    path = Path(root) / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def clear_stale_lock(directory: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """torch's JIT build serialises builders with a ``lock`` file and waits for it to disappear
    forever; a builder killed with SIGKILL (an OOM kill, a CI timeout) leaves it behind and every
    later start would hang. Remove a lock older than `max_age_s`; returns whether one was removed."""
    lock = directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < max_age_s:
        return False
    log.warning("phalanx: removing a stale kernel build lock %s (%.0f s old)", lock, age)
    lock.unlink(missing_ok=True)
    return True


def _wait_for_other_builder(directory: Path, max_age_s: float = STALE_LOCK_S) -> None:
    """Another process building holds the lock: wait for it, but never past `max_age_s`."""
    while (directory / "lock").exists() and not clear_stale_lock(directory, max_age_s):
        time.sleep(0.5)


BUILD_STAMP = "phalanx-build.json"  # beside a finished build: what it was built as (see `_import_built`)


def build(name: str = "phalanx_cpu_ops", march: str = "native", variant: str = "", defines: tuple[str, ...] = ()
          ) -> Any:
    """Compile (or load the cached build of) the csrc/ sources with ``-march=<march>`` (and
    ``-D<define>`` for each of `defines`) as module `name` in ``build_dir(variant)``."""
    sources = source_paths()
    directory = build_dir(variant)
    cflags = [*CFLAGS, *(f"-D{d}" for d in defines)]
    built_as = {"name": name, "march": march, "cflags": cflags}
    if not (directory / "lock").exists():
        module = _import_built(directory, built_as)
        if module is not None:
            return module
    from torch.utils.cpp_extension import load as load_extension

    _wait_for_other_builder(directory)
    (directory / BUILD_STAMP).unlink(missing_ok=True)  # rewritten once this build has loaded
    module = load_extension(
        name=name,
        sources=[str(p) for p in sources],
        extra_cflags=[f"-march={march}", *cflags],
        extra_include_paths=[str(CSRC)],
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        verbose=False,
    )
    try:
        (directory / BUILD_STAMP).write_text(json.dumps(built_as))
    except OSError:  # a read-only cache: later loads go through torch's check again
        pass
    return module


def _import_built(directory: Path, built_as: dict[str, Any]) -> Any:
    """The module a finished build left in `directory`, imported directly, or None. torch's
    ``load`` would first run ninja in a subprocess to confirm the build is current (with importing
    its build helpers 0.2-0.5 s of every engine start on a 2-core CPU); the folder's name already pins
    the sources, the CPU's flags and torch's version, and the stamp that `build` writes once a build
    has loaded pins the rest (module name, -march, compiler flags). A missing or different stamp, or
    a library that does not import, goes through torch's ``load`` (which rebuilds what it must)."""
    try:
        if json.loads((directory / BUILD_STAMP).read_text()) != built_as:
            return None
        spec = importlib.util.spec_from_file_location(built_as["name"], directory / f"{built_as['name']}.so")
        if spec is None or spec.loader is None:
            return None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except (OSError, ValueError, ImportError):
        return None


# The CPU features the emulated AMX build needs (amx_emulation.h and the AMX code around it).
AMX_EMULATION_NEEDS = ("avx512_bf16", "avx512bw")


def _isa_cap() -> str:
    """``PHALANX_CPU_ISA`` as given, normalised (not checked: `gemm_isa` checks it)."""
    return os.environ.get("PHALANX_CPU_ISA", "auto").strip().lower() or "auto"


def emulating_amx() -> bool:
    """Whether ``PHALANX_CPU_ISA=amx_emulated`` asks for the build whose AMX path runs in software."""
    return _isa_cap() == "amx_emulated"


def build_emulated_amx() -> Any:
    """The kernels built with AMX's tiles in software (csrc/amx_emulation.h): their AMX path (3) gives
    the bits an AMX CPU's does, on an AVX512-BF16 CPU without AMX, a few times slower. An error on a
    CPU without the AVX512 features it needs."""
    missing = [f for f in AMX_EMULATION_NEEDS if f not in cpu_flags()]
    if missing:
        raise ValueError(f"PHALANX_CPU_ISA='amx_emulated' needs a CPU with {' and '.join(AMX_EMULATION_NEEDS)}; "
                         f"this one lacks {', '.join(missing)}")
    return build(name="phalanx_cpu_ops_amx_emulated", variant="amx-emulated", defines=("PHALANX_EMULATE_AMX",))


@functools.cache
def _emulated_amx_build() -> Any:
    return build_emulated_amx()


def emulated_amx() -> Any:
    """The emulated AMX build (`build_emulated_amx`) beside whichever `load` gives (tests compare the
    two), or None where this CPU cannot run it or it does not build."""
    if backend() == "torch" or any(f not in cpu_flags() for f in AMX_EMULATION_NEEDS):
        return None
    try:
        with _lock:
            return _emulated_amx_build()
    except Exception as exc:  # no compiler / headers: the tests that need it skip
        log.warning("phalanx: the emulated AMX build failed: %s", (str(exc) or type(exc).__name__).splitlines()[0])
        return None


def load(required: bool = False) -> Any:
    """The compiled module, building it on first use; None when it cannot be built (one warning),
    or an error when ``required``. While ``PHALANX_CPU_ISA=amx_emulated``, the emulated AMX build
    instead (`build_emulated_amx`; an error, not a fallback, where it cannot be had: asked for by
    name), for the models loaded then (the choice is made per model, as the GEMM path's is)."""
    global _module, _failed
    if emulating_amx() and backend() != "torch":
        with _lock:
            return _emulated_amx_build()
    if _module is not None:
        return _module
    with _lock:
        if _module is None and _failed is None:
            try:
                log.info("phalanx: loading the C++ kernels from %s (the first use builds them, ~1 min)", build_dir())
                _module = build()
            except Exception as exc:  # no compiler / ninja / headers / sources: the reference path still works
                _failed = f"{type(exc).__name__}: {exc}".strip()[:2000]
                log.warning("phalanx: the C++ kernels could not be built (%s); using the PyTorch "
                            "reference ops", _failed.splitlines()[0])
    if _module is None and required:
        raise RuntimeError(f"PHALANX_KERNELS=cpp but the C++ kernels could not be built: {_failed}")
    return _module


def kernel_for(dtype: torch.dtype) -> Any:
    """The compiled module when its kernels should serve tensors of `dtype` (the decode attention:
    bf16 and fp32), else None."""
    choice = backend()
    if choice == "torch" or dtype not in SUPPORTED_DTYPES:
        return None
    return load(required=choice == "cpp")


def attach(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Give every layer under `model` that has a fused form (modules with a ``kernel`` attribute:
    RMSNorm, RotaryEmbedding, GatedMLP) the compiled module, when `model` computes in bf16 and the
    backend allows it. Call once after loading; returns how many modules got it."""
    if dtype != torch.bfloat16 or kernel_for(dtype) is None:
        return 0
    module = load()
    count = 0
    for m in model.modules():
        if hasattr(m, "kernel"):
            m.kernel = module
            count += 1
    return count


def decode_attention(
    module: Any,
    q: torch.Tensor,  # [S, Q, H, D]
    kv_cache: torch.Tensor,  # [2, kvh, num_blocks, block_size, D]
    block_table: torch.Tensor,  # [S, W] int64
    visible: torch.Tensor,  # [S, Q] int64: query i of sequence s attends keys 0 .. visible[s, i] - 1
    scale: float,
    isa: int,  # the forward's GEMM path (`gemm_isa`): 3 runs bf16 attention on AMX tiles
) -> torch.Tensor:  # [S, Q, H, D]
    return module.decode_attention(q, kv_cache, block_table, visible, float(scale), int(isa))


# PHALANX_CPU_ISA names -> the GEMM's path ids (csrc/gemm.h), best first (a cap: "avx512_bf16" on an
# AMX CPU takes its AVX512-BF16 path). "onednn" selects oneDNN's packed linear (not batch-invariant)
# for every bf16 linear.
GEMM_ISAS = {"amx": 3, "avx512_bf16": 2, "avx2": 1}
# "amx_emulated": the AMX path (3) in software (`build_emulated_amx`), on an AVX512-BF16 CPU.
ISA_CHOICES = ("auto", *GEMM_ISAS, "amx_emulated", "onednn")


def gemm_isa() -> int:
    """The path every bf16 linear takes (``layers.linear.PackedLinear``): the kernels' batch-invariant
    GEMM on AMX tiles (3), AVX512-BF16 (2) or AVX2 + FMA (1), the best this build has at or below
    ``PHALANX_CPU_ISA`` (auto: the best), or 0 — oneDNN's packed linear — when the kernels are off
    or cannot build, the CPU has none of them, or ``PHALANX_CPU_ISA=onednn``. AMX sums in an order
    of its own (csrc/gemm.cpp): batch-invariant like the others, not the same bits as them.
    ``PHALANX_CPU_ISA=amx_emulated``: the AMX path, its tiles emulated (`build_emulated_amx`)."""
    cap = _isa_cap()
    if cap not in ISA_CHOICES:
        raise ValueError(f"PHALANX_CPU_ISA={cap!r} is not valid; valid: {', '.join(ISA_CHOICES)}")
    module = kernel_for(torch.bfloat16)
    if cap == "onednn" or module is None:
        return 0
    if cap == "amx_emulated":
        return GEMM_ISAS["amx"]  # `load` gave the emulated build: it has the AMX path on any CPU it builds for
    allowed = [i for name, i in GEMM_ISAS.items() if cap == "auto" or i <= GEMM_ISAS[cap]]
    return next((i for i in module.gemm_isas() if i in allowed), 0)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of 2-D logits [N, V] (bf16 or float32) -> int64 [N]: the kernel when the
    backend allows it (no float32 copy of bf16 logits; torch's reduction over the last dim is
    scalar here), else ``x.argmax(-1)``. The same answer either way, ties and NaN included."""
    module = None
    if x.device.type == "cpu" and x.dim() == 2 and x.shape[1] > 0 and not x.requires_grad:
        module = kernel_for(x.dtype)
    return x.argmax(dim=-1) if module is None else module.argmax_rows(x)


def argmax_fn(dtype: torch.dtype) -> Any:
    """`argmax` resolved once for logits of `dtype` (a model's hot path: no backend look-up per
    call): the kernel's ``argmax_rows`` when it serves `dtype`, else torch's."""
    module = kernel_for(dtype)
    return module.argmax_rows if module is not None else _torch_argmax


def _torch_argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


def main() -> None:
    """Build the kernels ahead of time (``make install``); raises if they cannot be built."""
    t0 = time.perf_counter()
    load(required=True)
    print(f"phalanx: C++ kernels ready in {build_dir()} ({time.perf_counter() - t0:.1f}s)")

