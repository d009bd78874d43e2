"""The project as a whole: one installed package, ``ppoflow``, whose layers import downward only
(flows -> tasks -> algos, infra in the flow's process; workers -> algos, infra in the ranks), with
no import circles between modules or packages, and whose flow process loads no worker code (the
ranks do); the sideways rules between neighbours; the sizes of modules and functions; a test
module for every library module; and docs that name only files that exist.
"""

from __future__ import annotations

import ast
import functools
import glob
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

import ppoflow
from tests.support.paths import ROOT

#: The installed package's folder: its sub-packages are links to the top-level folders (and any
#: folder of its own), so a new sub-package (``ppoflow.cli``) is found without naming it here.
PACKAGE_DIR = os.path.join(ROOT, "ppoflow")
PACKAGES = tuple(
    sorted(n for n in os.listdir(PACKAGE_DIR) if os.path.isfile(os.path.join(PACKAGE_DIR, n, "__init__.py")))
)

#: Library modules without a test module at the mirrored path, and where they are tested instead
#: (modules whose behaviour only a multi-rank or whole-flow test shows).
TESTED_ELSEWHERE: dict[str, str] = {
    "cli/demo.py": "tests/scenarios/test_demo.py (the demo command, run once per session)",
    "cli/promotion.py": "tests/scenarios/test_flow_data.py (promote, then again, then roll back)",
    "flows/export.py": "tests/scenarios/test_flow_data.py (what a promotion publishes) and tests/flows/test_deployment.py",
    "demo/experiment.py": "tests/scenarios/test_demo.py (prepare builds the demo's experiment, the demo run uses it)",
    "infra/checkpoint/_dist.py": "tests/infra/checkpoint/test_sharded.py (its collectives, in one process and on ranks)",
    "infra/checkpoint/staging.py": "tests/infra/checkpoint/test_writer.py (every background write stages through it)",
    "infra/checkpoint/lora_export.py": "tests/scenarios/test_flow_lora.py (a LoRA run's checkpoints exported as a PEFT adapter)",
    "infra/envs/openenv.py": "tests/workers/rollout/test_openenv_rollout.py (OpenEnv's own server, a multi-turn rollout)",
    "infra/rewards/reasoning_gym.py": "tests/infra/datasets/test_reasoning_gym.py (files written and scored by each task's own scorer)",
    "infra/remote/driver/launchers.py": "tests/infra/remote/driver/test_group.py (LocalLauncher starts every group there)",
    "infra/remote/driver/replies.py": "tests/infra/remote/driver/test_group.py (every call's replies, ranks that raise or die)",
    "infra/remote/driver/rendezvous.py": "tests/infra/remote/test_multinode.py (groups over node agents)",
    "infra/remote/links.py": "tests/infra/remote/driver/test_hub.py (strangers refused) and tests/infra/remote/test_multinode.py",
    "infra/remote/rank/entry.py": "tests/infra/remote/driver/test_group.py (every rank runs it: calls, faults, a dead driver)",
    "infra/remote/rank/launch.py": "tests/infra/remote/test_procs.py (its torchrun arguments) and tests/infra/remote/driver/test_group.py (every local group starts through it)",
    "tasks/score.py": "tests/flows/test_ppo.py (its three reads of every rollout, on their groups)",
    "tasks/update.py": "tests/scenarios/test_flow_snapshots.py (updates that snapshot, defer or record for replay)",
    "tasks/checkpoints.py": "tests/scenarios/test_flow_checkpoints.py (the flow's checkpoint writes and their lineage)",
    "tasks/preflight.py": "tests/flows/test_ppo.py (every flow run starts with it); the checks: tests/infra/test_preflight.py",
    "tasks/replay.py": "tests/scenarios/test_flow_snapshots.py (states rebuilt from snapshots by replay)",
    "tasks/run/inputs.py": "tests/flows/test_ppo.py (the tokenizer and prompts every task of a run shares)",
    "tasks/run/materialize.py": "tests/scenarios/test_flow_snapshots.py (a committed state written out as a checkpoint)",
    "workers/actor.py": "tests/workers/test_actor_rollout_ref_worker.py (against a plain single-process PPO update)",
    "workers/critic.py": "tests/workers/test_critic_worker.py (against a plain single-process value update)",
    "workers/checkpointing.py": "tests/workers/test_actor_rollout_ref_worker.py and tests/workers/test_critic_worker.py (the workers' saves) and the flow scenarios",
    "workers/compiled.py": "tests/workers/test_packing.py (compiled and eager forwards compared)",
    "workers/hf_models.py": "tests/workers/test_packing.py and tests/workers/test_actor_rollout_ref_worker.py (the models they build)",
    "workers/modeling.py": "tests/workers/test_packing.py (packed against padded forwards) and tests/workers/test_lora.py",
}

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
#: A function over MAX_FUNCTION_LINES says why in its docstring, in a sentence starting so.
LONG_REASON = "Long because"


def _modules() -> dict[str, str]:
    """``ppoflow.<dotted name>`` -> file, for every module of the library."""
    out = {}
    for pkg in PACKAGES:
        for folder, _, files in os.walk(os.path.join(PACKAGE_DIR, pkg)):
            for name in files:
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, name), PACKAGE_DIR)[:-3].replace(os.sep, ".")
                    out["ppoflow." + rel.removesuffix(".__init__")] = os.path.join(folder, name)
    return out


def _repo_path(path: str) -> str:
    """A library file as the repository holds it (``flows/ppo.py``; links resolved)."""
    return os.path.relpath(os.path.realpath(path), os.path.realpath(ROOT))


@functools.cache
def _parsed(path: str) -> ast.Module:
    with open(path) as f:
        return ast.parse(f.read())


def _imports(path: str, modules: dict[str, str] | None = None) -> set[str]:
    """Every ``ppoflow`` module ``path`` imports, at the top or inside a function. ``from pkg
    import mod`` counts as an import of ``pkg.mod`` (``pkg`` is initialised before either)."""
    found = set()
    for node in ast.walk(_parsed(path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ppoflow"):
            subs = {f"{node.module}.{a.name}" for a in node.names}
            known = {m for m in subs if modules is not None and m in modules}
            found |= known or {node.module}
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("ppoflow"))
    return found


def _under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_lower_layers_never_import_upper_ones():
    rules = {
        "ppoflow.algos": (
            "ppoflow.cli",
            "ppoflow.flows",
            "ppoflow.tasks",
            "ppoflow.workers",
            "ppoflow.demo",
            "ppoflow.infra",
        ),
        "ppoflow.infra": ("ppoflow.cli", "ppoflow.flows", "ppoflow.tasks", "ppoflow.workers", "ppoflow.demo"),
        "ppoflow.workers": ("ppoflow.cli", "ppoflow.flows", "ppoflow.tasks", "ppoflow.demo"),
        "ppoflow.tasks": ("ppoflow.cli", "ppoflow.flows", "ppoflow.demo", "ppoflow.workers"),
        "ppoflow.flows": ("ppoflow.workers",),
        "ppoflow.flows.ppo": ("ppoflow.demo",),
        "ppoflow.cli": ("ppoflow.workers",),
    }
    bad = []
    for module, path in _modules().items():
        for layer, forbidden in rules.items():
            if module == layer or module.startswith(layer + "."):
                bad += [(module, i) for i in _imports(path) if i.startswith(forbidden)]
    assert not bad, bad


def test_no_import_circles():
    """No module imports one that imports it back, directly or through others, counting the
    imports inside functions too (a circle there is a circle a reader has to untangle)."""
    modules = _modules()
    graph = {m: {i for i in _imports(p, modules) if i in modules and i != m} for m, p in modules.items()}
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(nxt) :] + [node, nxt]))
            if nxt not in state:
                visit(nxt, [*stack, node])
        state[node] = 2

    for m in graph:
        if m not in state:
            visit(m, [])


def test_no_package_circles():
    """Within each package its modules and sub-packages (each sub-package one node, standing for
    everything under it) import one another without a circle: two packages never each use the
    other (``infra.data`` and ``infra.checkpoint``, say), even through a third."""
    modules = _modules()
    graph: dict[str, dict[str, tuple[str, str]]] = {}
    for module, path in modules.items():
        for imported in _imports(path, modules):
            if imported not in modules:
                continue
            a, b = module.split("."), imported.split(".")
            k = 0
            while k < min(len(a), len(b)) - 1 and a[k] == b[k]:
                k += 1
            src, dst = ".".join(a[: k + 1]), ".".join(b[: k + 1])
            if src != dst:  # siblings under their deepest common package
                graph.setdefault(src, {}).setdefault(dst, (module, imported))
    circles = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, {}):
            if state.get(nxt) == 1:
                loop = [*stack[stack.index(nxt) :], node, nxt] if nxt in stack else [node, nxt]
                edges = [" -> ".join(graph[x][y]) for x, y in zip(loop, loop[1:])]
                circles.append(" -> ".join(loop) + " (" + "; ".join(edges) + ")")
            elif nxt not in state:
                visit(nxt, [*stack, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not circles, "package circles:\n" + "\n".join(circles)


#: infra's leaves: what the rest of infra and the layers above all use, so they use none of it.
INFRA_LEAVES = ("ppoflow.infra.runtime", "ppoflow.infra.models", "ppoflow.infra.plugins")
_INFRA_DIR = os.path.join(PACKAGE_DIR, "infra")
_INFRA_PACKAGES = tuple(
    sorted(
        f"ppoflow.infra.{n}"
        for n in os.listdir(_INFRA_DIR)
        if os.path.isfile(os.path.join(_INFRA_DIR, n, "__init__.py"))
    )
)

#: Neighbours that must not lean on each other: (importers, what they must not import, why).
SIDEWAYS = (
    (
        INFRA_LEAVES,
        tuple(p for p in _INFRA_PACKAGES if p not in INFRA_LEAVES),
        "infra's leaves import nothing of infra's other packages: the runtime (signals, CPU use, "
        "fault drills) serves the CLI, the tasks, the checkpoint writer and the ranks alike; the "
        "models' registry (hub ids, rollout engines) is what the config validates against; the loader "
        "of user objects serves rewards, environments and the queue's admission alike",
    ),
    (
        ("ppoflow.infra.remote",),
        ("ppoflow.infra.experiment",),
        "the remote-call layer knows no metric names: workers declare how their metrics merge "
        "(@register(..., metrics=...), infra/remote/metric_merge.py)",
    ),
    (
        ("ppoflow.infra.data", "ppoflow.infra.remote"),
        ("ppoflow.infra.checkpoint",),
        "the data plane and the rank runtime need no checkpoint code (hashes: infra/data/hashing.py; "
        "seeding: infra/remote/rank/seeding.py)",
    ),
    (("ppoflow.flows",), ("ppoflow.cli",), "the flows import no command-line module"),
    (
        ("ppoflow.tasks.generate", "ppoflow.tasks.evaluate"),
        ("ppoflow.tasks.advantage",),
        "a task takes no scoring helper from another task: scoring lives below the tasks",
    ),
)


@pytest.mark.parametrize("importers, forbidden, why", SIDEWAYS, ids=[r[1][0] for r in SIDEWAYS])
def test_sideways_rules(importers, forbidden, why):
    modules = _modules()
    bad = []
    for module, path in modules.items():
        if _under(module, *importers):
            bad += [f"{module} imports {i}" for i in _imports(path, modules) if _under(i, *forbidden)]
    assert not bad, f"{why}:\n" + "\n".join(bad)


def _function_lengths(path: str):
    """(name, lines from ``def`` to its last line, docstring) of every function and method."""
    for node in ast.walk(_parsed(path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno is not None
            yield node.name, node.end_lineno - node.lineno + 1, ast.get_docstring(node) or ""


def _size_violations() -> list[str]:
    out = []
    for path in sorted(set(_modules().values())):
        rel = _repo_path(path)
        with open(path) as f:
            lines = len(f.read().splitlines())
        if lines > MAX_MODULE_LINES:
            out.append(f"lines: {rel}")
        for name, length, doc in _function_lengths(path):
            if length > MAX_FUNCTION_LINES and not re.search(rf"(^|[.!?]\s+){LONG_REASON}\b", doc):
                out.append(f"function: {rel}:{name}")
    return out


def test_modules_and_functions_stay_small():
    """A module over MAX_MODULE_LINES holds two things; a function over MAX_FUNCTION_LINES says
    why in its docstring, in a sentence that starts with LONG_REASON ("Long because the steps
    share ... and read best in order.")."""
    bad = _size_violations()
    assert not bad, (
        f"modules over {MAX_MODULE_LINES} lines / functions over {MAX_FUNCTION_LINES} lines "
        f"whose docstring gives no reason ('{LONG_REASON} ...'):\n" + "\n".join(bad)
    )


def _mirrored_test(path: str) -> str:
    """``tests/<package path>/test_<module>.py`` of a library file (``flows/ppo.py`` ->
    ``tests/flows/test_ppo.py``)."""
    rel = os.path.relpath(path, PACKAGE_DIR)
    folder, name = os.path.split(rel)
    return os.path.join("tests", folder, "test_" + name)


def _package_test(path: str) -> str:
    """``tests/<parent path>/test_<package>.py`` of a module in a sub-package: one test module
    may cover a small package whose modules implement one contract (the storage backends)."""
    rel = os.path.relpath(path, PACKAGE_DIR)
    package = os.path.dirname(rel)
    return os.path.join("tests", os.path.dirname(package), "test_" + os.path.basename(package) + ".py")


def _untested() -> list[str]:
    return sorted(
        _repo_path(path)
        for path in set(_modules().values())
        if os.path.basename(path) not in ("__init__.py", "__main__.py")
        and not os.path.exists(os.path.join(ROOT, _mirrored_test(path)))
        and not os.path.exists(os.path.join(ROOT, _package_test(path)))
    )


def test_every_library_module_has_a_test_module_at_the_mirrored_path():
    """``tests/<package path>/test_<module>.py`` for every module (a package's ``__init__`` is
    tested with its modules; a small package's modules may share ``tests/<parent>/test_<package>.py``),
    or the module is named in TESTED_ELSEWHERE with the test that covers it."""
    bad = [m for m in _untested() if m not in TESTED_ELSEWHERE]
    assert not bad, (
        "no tests/<package path>/test_<module>.py (write it, or name the module in TESTED_ELSEWHERE):\n"
        + "\n".join(bad)
    )
    stale = [m for m in TESTED_ELSEWHERE if m not in _untested()]
    assert not stale, f"TESTED_ELSEWHERE names modules that have a mirrored test or are gone: {stale}"
    for module, where in TESTED_ELSEWHERE.items():
        named = re.findall(r"tests/[\w/]+\.py", where)
        assert named and all(os.path.exists(os.path.join(ROOT, t)) for t in named), (module, where)


_MAP_LINE = re.compile(r"^\s*((?:[A-Za-z_]\w*(?:\.py|/)(?:,\s*)?)+)\s")


def test_package_docstrings_map_what_exists():
    """A package docstring that maps its folder (lines starting ``name/`` or ``name.py``, at the
    map's indentation) names every module and sub-package there, and nothing that is not."""
    for module, path in _modules().items():
        if os.path.basename(path) != "__init__.py":
            continue
        doc = ast.get_docstring(_parsed(path)) or ""
        rows = [
            (len(line) - len(line.lstrip()), m.group(1))
            for line in doc.splitlines()
            if (m := _MAP_LINE.match(line + " "))
        ]
        if not rows:
            continue
        indent = min(i for i, _ in rows)  # deeper lines continue an entry
        named = {n.strip() for i, names in rows if i == indent for n in names.split(",") if n.strip()}
        folder = os.path.dirname(path)
        there = {
            n + "/" if os.path.isdir(os.path.join(folder, n)) else n
            for n in os.listdir(folder)
            if (n.endswith(".py") and n != "__init__.py")
            or os.path.isfile(os.path.join(folder, n, "__init__.py"))
        }
        assert named == there, (
            f"{module}'s map: missing {sorted(there - named)}, gone {sorted(named - there)}"
        )


#: File names the library uses more than once, each with the one meaning its folder gives it; any
#: other name means one thing (a second ``hub.py`` or ``memory.py`` would need a name of its own).
SHARED_NAMES: dict[str, str] = {
    "__init__.py": "a package",
    "__main__.py": "what ``python -m`` runs",
    "base.py": "the interface of the package's kind and its registry (environments, storage backends, rollout engines)",
    "teacher.py": "the teacher's part of its layer: its config section, its preflight check, its ranks' model",
    "multiturn.py": "multi-turn rollouts' part of its layer: config section, preflight check, the rollout",
    "correction.py": "rollout correction: its math (algos/) and its config section (config/)",
    "evaluation.py": "held-out evaluation: its config section (config/) and its stored results (experiment/)",
    "tracking.py": "experiment tracking: its config section (config/) and the trackers (experiment/)",
    "experiment.py": "an experiment's config: the schema (config/) and the demo's own (demo/)",
    "data.py": "training data: its command (cli/) and its preflight check (preflight/)",
    "promotion.py": "promotion: its command (cli/) and its rule and records (experiment/)",
    "evaluate.py": "evaluating an iteration: the ppo-eval flow (flows/) and its task (tasks/)",
    "mismatch.py": "the sampler/trainer mismatch: its measure (algos/) and its step in the advantage task (tasks/)",
    "reasoning_gym.py": "reasoning-gym's part of its package: its rewards (rewards/) and its data files (datasets/)",
}


def test_a_file_name_means_one_thing():
    """A file name used twice in the library is one of SHARED_NAMES (the folder says its meaning);
    any other repeat names two different things and needs a name of its own."""
    seen: dict[str, list[str]] = {}
    for path in sorted(set(_modules().values())):
        seen.setdefault(os.path.basename(path), []).append(_repo_path(path))
    repeated = {name: paths for name, paths in seen.items() if len(paths) > 1}
    bad = {name: paths for name, paths in repeated.items() if name not in SHARED_NAMES}
    assert not bad, f"one file name, two meanings (rename one, or say why in SHARED_NAMES): {bad}"
    stale = sorted(set(SHARED_NAMES) - set(repeated))
    assert not stale, f"SHARED_NAMES names files no longer repeated: {stale}"


#: Repository files named in the README and docs/ (a path with a folder, ending in a file name).
_DOC_PATH = re.compile(
    r"(?<![\w/.~-])((?:\.ci|[A-Za-z_][\w.-]*)(?:/[\w.-]+)*/[\w-]+\.(?:py|md|yaml|yml|toml|sh|txt|log|json|cfg))\b"
)


def test_docs_name_only_files_that_exist():
    top = set(os.listdir(ROOT)) | {".ci"}
    bad = []
    for doc in [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
        with open(doc) as f:
            for n, line in enumerate(f, 1):
                for m in _DOC_PATH.finditer(line):
                    path = m.group(1)
                    if path.split("/")[0] in top and not os.path.exists(os.path.join(ROOT, path)):
                        bad.append(f"{os.path.relpath(doc, ROOT)}:{n}: {path}")
    assert not bad, "paths that do not exist:\n" + "\n".join(bad)


@pytest.mark.slow  # builds a wheel (~15 s)
def test_wheel_puts_only_ppoflow_at_the_top_level(tmp_path):
    src = tmp_path / "src"  # build from a copy: setuptools leaves build/ in the tree it builds
    skip = shutil.ignore_patterns(".venv", ".git", "runs", "build", "*.egg-info", ".gpu-*", "__pycache__")
    shutil.copytree(ROOT, src, ignore=skip)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(tmp_path),
        ".",
    ]
    subprocess.run(cmd, check=True, capture_output=True, cwd=src)
    (wheel,) = tmp_path.glob("ppoflow-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"ppoflow", f"ppoflow-{ppoflow.__version__}.dist-info"}
    for module in (
        "ppoflow/cli/main.py",
        "ppoflow/flows/ppo.py",
        "ppoflow/tasks/step.py",
        "ppoflow/workers/rollout/vllm_rollout.py",
        "ppoflow/algos/advantages.py",
        "ppoflow/infra/data/dataproto.py",
        "ppoflow/infra/remote/rank/entry.py",
        "ppoflow/infra/remote/rank/__main__.py",  # what a forked rank runs
        "ppoflow/infra/remote/protocol.py",
        "ppoflow/infra/experiment/manifest.py",
        "ppoflow/infra/checkpoint/sharded.py",
        "ppoflow/demo/task.py",
    ):
        assert module in names, module
    entry_points = zipfile.ZipFile(wheel).read(f"ppoflow-{ppoflow.__version__}.dist-info/entry_points.txt")
    assert b"ppoflow = ppoflow.cli.main:main" in entry_points


def test_no_bare_top_level_modules_import():
    """`import tasks` / `import workers` etc. find nothing of ours outside the checkout's root."""
    code = "import importlib.util as u; print([m for m in ('cli','flows','tasks','workers','infra','algos','demo') if u.find_spec(m)])"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the checkout's root is not "outside"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd="/", env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
    out = subprocess.run(
        [sys.executable, "-c", "import ppoflow.flows.ppo, ppoflow.infra.remote.rank.entry; print('ok')"],
        cwd="/",
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "ok"


def test_the_flow_process_imports_no_worker_code():
    """The driver builds worker groups from import paths and the method tables the ranks send:
    the flow, its tasks and the CLI import nothing of ``ppoflow.workers`` (FSDP models, vLLM,
    packing), so a flow run starts fast and needs no GPU libraries."""
    code = (
        "import sys, ppoflow.cli.main, ppoflow.flows.ppo, ppoflow.flows.deployment, ppoflow.tasks; "
        "print(sorted(m for m in sys.modules if m.startswith('ppoflow.workers') or m == 'vllm'))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
