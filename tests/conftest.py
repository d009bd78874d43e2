import json
import os

import pytest

from tests.support.ckpt.checkpoint_run import ckpt_run  # noqa: F401
from tests.support.mlflow_server import mlflow_server  # noqa: F401
from tests.support.s3_server import s3_server  # noqa: F401

# ----------------------------------------------------------------------------- two workers
#: Session fixtures that run flows (tens of seconds each). ``make test`` runs the slow tier on two
#: pytest-xdist workers (``--dist loadgroup``), and each worker builds the session fixtures its own
#: tests use: the modules that use one of these go to one worker, which builds it once.
SHARED_RUNS = ("base_run", "light_run", "demo", "ckpt_run")
#: vLLM's CPU build names a tensor-parallel engine's shared memory after its launcher's address,
#: which under torch's launcher (``env://``) is the same for every engine on the host: two such
#: engines at once collide ("create shm in SHMManager failed. errno: 17"). The tests that start one
#: (marked ``cpu_tp``, or using the rollout scenarios ``dp2``/``tp2``, whose ``tp2`` is one) are
#: one group: one worker runs them one after the other, and builds the scenarios once.
CPU_TP_GROUP, CPU_TP_FIXTURES = "cpu_tp", ("dp2", "tp2")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks
def pytest_collection_modifyitems(config, items):
    """An ``xdist_group`` for every test: its module (module fixtures are built once), or, for a
    module that uses one of :data:`SHARED_RUNS`, that run (a module using two is split by test,
    each with the first run it uses). A test of such a module that uses neither a shared run nor
    a module fixture is a group of its own: it need not wait behind the run's group (the demo's
    learning test, minutes long, beside the ``light_run`` tests). Without xdist the marks change
    nothing."""

    def runs_of(item) -> list[str]:
        return [run for run in SHARED_RUNS if run in getattr(item, "fixturenames", ())]

    def shares_module_state(item) -> bool:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        return any(d and d[-1].scope in ("module", "class", "package") for d in defs)

    module_runs: dict[str, list[str]] = {}
    groups: dict = {}
    for item in items:
        runs = module_runs.setdefault(item.module.__name__, [])
        runs.extend(run for run in runs_of(item) if run not in runs)
    for item in items:
        module, runs = item.module.__name__, runs_of(item)
        fixtures = getattr(item, "fixturenames", ())
        if item.get_closest_marker("cpu_tp") or any(f in fixtures for f in CPU_TP_FIXTURES):
            group = CPU_TP_GROUP
        elif runs:
            group = runs[0]
        elif module_runs[module] and not shares_module_state(item):
            group = item.nodeid.replace("/", ".").replace("::", ".")
        else:
            group = (module_runs[module] or [module])[0]
        item.add_marker(pytest.mark.xdist_group(group))
        groups[item] = group
    # (an xdist worker sees ``dist`` as "no" and ``loadgroup`` set; the controller, or a run
    # without -n, the option itself)
    if getattr(config.option, "loadgroup", False) or config.getoption("dist", "no") == "loadgroup":
        _longest_groups_first(items, groups)


# ----------------------------------------------------------------------------- longest first
#: What each slow test took (seconds, setup + call + teardown, on two busy cores), by node id.
#: ``make test`` runs the slow tier with ``--no-loadscope-reorder``: pytest-xdist hands the groups
#: out in collection order, which :func:`_longest_groups_first` makes longest first (by these
#: figures) so that no minutes-long group is left for the end while the other worker idles.
#: xdist's own order (most tests first) put the single-test groups of minutes (the deployment, the
#: demo learning, the TP=2 check) last. Refresh after adding or changing slow tests:
#: ``PPOFLOW_RECORD_DURATIONS=1 make test`` (it rewrites the entries of the tests that ran).
DURATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.json")
#: A slow test without a recorded figure counts as this many seconds (a typical flow test).
UNRECORDED_SLOW_S = 30.0


def _recorded_durations() -> dict[str, float]:
    try:
        with open(DURATIONS) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def _longest_groups_first(items, groups) -> None:
    """Reorder ``items`` in place: whole groups, the longest (summed recorded seconds) first, each
    group's tests in their collected order."""
    recorded = _recorded_durations()

    def seconds(item) -> float:
        if item.nodeid in recorded:
            return recorded[item.nodeid]
        marks = {m.name for m in item.iter_markers()}
        return UNRECORDED_SLOW_S if marks & {"slow", "integration"} else 0.0

    total: dict[str, float] = {}
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        total[groups[item]] = total.get(groups[item], 0.0) + seconds(item)
        first.setdefault(groups[item], i)
    items.sort(key=lambda item: (-total[groups[item]], first[groups[item]]))


_durations: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """With ``PPOFLOW_RECORD_DURATIONS`` set, add up each slow test's phases (the controller's view
    under xdist, the group suffix dropped) for :func:`pytest_sessionfinish` to record."""
    if os.environ.get("PPOFLOW_RECORD_DURATIONS") and {"slow", "integration"} & set(report.keywords):
        nodeid = report.nodeid.rpartition("@")[0] or report.nodeid
        _durations[nodeid] = _durations.get(nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    """Write the slow tests' figures into :data:`DURATIONS` (a worker leaves it to the controller)."""
    if not _durations or hasattr(session.config, "workerinput"):
        return
    recorded = _recorded_durations()
    recorded.update({k: round(v, 1) for k, v in _durations.items()})
    with open(DURATIONS, "w") as f:
        json.dump(dict(sorted(recorded.items())), f, indent=0)
        f.write("\n")


def pytest_configure(config):
    """``--dist loadgroup`` with a pytest and pytest-xdist known not to keep groups: say so before
    any worker starts (the workers' own check below would end in an INTERNALERROR)."""
    if config.getoption("dist", "no") != "loadgroup" or hasattr(config, "workerinput"):
        return
    import xdist

    xdist_version = tuple(int(p) for p in xdist.__version__.split(".")[:2])
    if pytest.version_tuple[:2] >= (9, 2) and xdist_version <= (3, 8):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} with pytest-xdist {xdist.__version__} runs `--dist loadgroup` "
            "as `--dist load` (tests of one group on different workers, each building the shared "
            "runs again): install the test extra's pins (pyproject.toml: pytest<9.2)"
        )


def pytest_collection_finish(session):
    """On an xdist worker under ``--dist loadgroup``: every test's node id carries its group (the
    marks above). When it does not (pytest 9.2 with pytest-xdist 3.8 drops the suffix), tests of one
    group run on different workers and each builds the shared runs again: stop at once."""
    if getattr(session.config.option, "loadgroup", False) and session.items:
        lost = [item.nodeid for item in session.items if "@" not in item.nodeid]
        if lost:
            raise pytest.UsageError(
                f"--dist loadgroup: {len(lost)} test(s) lost their xdist_group (e.g. {lost[0]}): this "
                "pytest and pytest-xdist do not keep groups together; install the test extra's pins "
                "(pyproject.toml: pytest<9.2), or run the slow tier without -n"
            )


# ----------------------------------------------------------------------------- flow tests
@pytest.fixture(scope="session", autouse=True)
def _session_device_slots(tmp_path_factory):
    """The session's runs (and the processes they start) share device slots among themselves, not
    with other ppoflow runs on the machine (``ppoflow.infra.remote.driver.slots``)."""
    import os

    os.environ["PPOFLOW_SLOTS_DIR"] = str(tmp_path_factory.mktemp("device-slots"))


@pytest.fixture(autouse=True)
def _fresh_faults():
    """Every test starts with no injected fault spent: an entry that fired in an earlier test of
    the session (the same ``PPOFLOW_FAULT`` text) fires again in this one."""
    from ppoflow.infra.runtime import faults

    faults.reset()


@pytest.fixture(scope="session", autouse=True)
def _stop_local_prefect_server():
    """Stop the local Prefect API server an in-process CLI run of the session started (its process
    would end with pytest's anyway) while pytest's output is still open."""
    yield
    import sys

    module = sys.modules.get("ppoflow.cli.local_api")
    server = getattr(module, "_SERVER", None)
    if server is not None:
        server.stop()


@pytest.fixture(scope="session")
def prefect_harness():
    """A temporary Prefect API (``prefect_test_harness``) for the whole session: ~10 s, once."""
    import os

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def _write_gsm8k_like(path, n: int) -> str:
    """``n`` veRL-format rows ("what is a+b?", GSM8K rule, answer as ground truth)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{i}+{i % 5}="}],
            "ability": "math",
            "reward_model": {"ground_truth": str(i + i % 5), "style": "rule"},
            "extra_info": {"index": i},
        }
        for i in range(n)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture(scope="session")
def flow_assets(tmp_path_factory):
    """A tiny policy, a tiny reward model and 12 prompts, built once per session."""
    from ppoflow.demo.tiny_models import save_tiny_model, save_tiny_reward_model

    base = tmp_path_factory.mktemp("flow-assets")
    return {
        "model": save_tiny_model(str(base / "policy"), seed=0),
        "rm": save_tiny_reward_model(str(base / "rm"), seed=1),
        "data": _write_gsm8k_like(base / "train.parquet", 12),
    }


@pytest.fixture(scope="session")
def flow_config(flow_assets):
    """``make(root, experiment, **dotted_overrides) -> ExperimentConfig``: the tiny PPO config of
    the flow tests (2 CPU ranks, vLLM, GAE with a critic, a reward model + the GSM8K rule, an
    adaptive KL penalty in the reward: every task of the graph runs). With a ``recipe`` override
    the algorithm section is the recipe's (the overrides may still set its keys)."""
    from ppoflow.infra.config import apply_overrides, parse_config

    def make(root: str, experiment: str, **over):
        data = {
            "model": {"path": flow_assets["model"]},
            "data": {"train_files": [flow_assets["data"]], "train_batch_size": 4, "seed": 0},
            "rollout": {
                "engine": "vllm",
                "n": 2,
                "prompt_length": 16,
                "response_length": 8,
                "kv_cache_gib": 0.02,
                "max_num_seqs": 16,
                "log_prob_micro_batch_size_per_gpu": 4,
            },
            "actor": {
                "ppo_mini_batch_size": 2,
                "ppo_micro_batch_size_per_gpu": 2,
                "log_prob_micro_batch_size_per_gpu": 4,
                "optim": {"lr": 1e-3},
            },
            "ref": {"log_prob_micro_batch_size_per_gpu": 4},
            "critic": {
                "ppo_mini_batch_size": 2,
                "ppo_micro_batch_size_per_gpu": 2,
                "forward_micro_batch_size_per_gpu": 4,
                "optim": {"lr": 1e-3},
            },
            "reward": {
                "rule": True,
                "reward_model": {
                    "enable": True,
                    "model": {"path": flow_assets["rm"]},
                    "micro_batch_size_per_gpu": 4,
                },
            },
            "algorithm": {
                "adv_estimator": "gae",
                "use_kl_in_reward": True,
                "kl_ctrl": {"type": "adaptive", "kl_coef": 0.05, "target_kl": 0.01, "horizon": 50},
            },
            "storage": {"root": root, "experiment": experiment},
            "resources": {"nprocs": 2, "device": "cpu"},
            # every state written: the flow tests compare checkpoints of every iteration (the
            # snapshot tests set snapshot_every themselves)
            "checkpoint": {"snapshot_every": 1},
            "seed": 7,
        }
        if "recipe" in over:
            del data["algorithm"]
        return parse_config(apply_overrides(data, over), source="flow test config")

    return make


@pytest.fixture(scope="session")
def base_run(prefect_harness, flow_config, tmp_path_factory):
    """The uninterrupted reference: a new experiment, 2 iterations in one flow run."""
    import time

    from ppoflow.flows.ppo import ppo

    root = str(tmp_path_factory.mktemp("base-run"))
    cfg = flow_config(root, "exp")
    t0 = time.perf_counter()
    state = ppo(cfg, iterations=2, return_state=True)
    wall = time.perf_counter() - t0
    return {
        "cfg": cfg,
        "root": root,
        "url": cfg.storage.experiment_url,
        "state": state,
        "result": state.result(),
        "wall_s": wall,
    }


@pytest.fixture(scope="session")
def light_run(prefect_harness, flow_config, tmp_path_factory):
    """The uninterrupted reference of the one-group (``LIGHT``) flow tests: 2 iterations in one
    flow run, local files; returns the experiment's URL."""
    from ppoflow.flows.ppo import ppo
    from tests.support.configs import LIGHT

    cfg = flow_config(str(tmp_path_factory.mktemp("light-run")), "reference", **LIGHT)
    assert ppo(cfg, iterations=2)["iteration"] == 2
    return cfg.storage.experiment_url


# ----------------------------------------------------------------------------- FSDP worker tests
@pytest.fixture
def one_thread():
    """In-process reference computations on one thread (two threads on two busy cores are slower)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A tiny Qwen2 and a batch for the FSDP worker tests: ``{dir, batch, tmp}``."""
    from ppoflow.demo.tiny_models import save_tiny_model
    from tests.support.fsdp.ppo_reference import make_batch

    d = str(tmp_path_factory.mktemp("tiny"))
    save_tiny_model(d, seed=0)
    return {"dir": d, "batch": make_batch(d), "tmp": tmp_path_factory.mktemp("io")}


# ----------------------------------------------------------------------------- the demo
@pytest.fixture(scope="session")
def demo(prefect_harness, tmp_path_factory) -> dict:
    """The demo at a small size (``tests.support.small_demo.SMALL``), run once per session:
    ``{root, url, run, lines, mtimes}``."""
    import os

    from ppoflow.cli.demo import run_demo
    from tests.support.small_demo import SMALL

    root = str(tmp_path_factory.mktemp("demo") / "demo")
    lines: list[str] = []
    run = run_demo(root, iterations=2, spec=SMALL, out=lines.append)
    mtimes = {
        name: os.path.getmtime(os.path.join(root, name))
        for name in ("models/base", "models/sft", "data/train.parquet", "config.yaml")
    }
    return {
        "root": root,
        "url": os.path.join(root, "larger-digit"),
        "run": run,
        "lines": lines,
        "mtimes": mtimes,
    }
