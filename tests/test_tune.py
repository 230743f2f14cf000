"""tune: one MetaSchedule database per target, applied by compile (the long run is slow-marked)."""

import json

import numpy as np
import onnx
import pytest

from graphs import rel_err
from tvm_layerfuse.compile.build import compile_model
from tvm_layerfuse.compile.tune import tune_model
from tvm_layerfuse.compile.tune_database import database_dir, has_database
from tvm_layerfuse.errors import UsageError
from tvm_layerfuse.lowering import LayerfusePipeline
from tvm_layerfuse.runtime import load
from tvm_layerfuse.testing import random_cnn, random_inputs, run_onnxruntime


def test_one_database_per_target(tmp_path, monkeypatch):
    monkeypatch.setenv("TVM_LAYERFUSE_CACHE", str(tmp_path))
    a = database_dir({"kind": "llvm", "mcpu": "znver4"})
    b = database_dir({"kind": "llvm", "mcpu": "x86-64"})
    assert a != b and a == database_dir({"mcpu": "znver4", "kind": "llvm"})
    assert a.parent == tmp_path / "tune" and "znver4" in a.name
    assert not has_database(a)


def test_the_pipeline_applies_a_database_after_the_lowering_passes(tmp_path):
    import tvm

    tgt = tvm.target.Target({"kind": "llvm"})
    with tgt:
        names = [p.info.name for p in LayerfusePipeline(tgt, database=str(tmp_path)).passes()]
        plain = [p.info.name for p in LayerfusePipeline(tgt).passes()]
    k = names.index("MetaScheduleApplyDatabase")
    assert names[k - 2 : k] == ["InPlaceConcat", "NarrowBlockedIndices"] and names.index("FuseTIR") < k
    assert "MetaScheduleApplyDatabase" not in plain


@pytest.mark.parametrize("kw, fragment", [({"trials": 0}, "--trials 0"), ({"budget": -1.0}, "--budget -1.0")])
def test_bad_bounds_are_refused(kw, fragment, tmp_path):
    with pytest.raises(UsageError) as e:
        tune_model(tmp_path / "unused.onnx", **kw)
    assert fragment in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_tune_then_compile_applies_the_database(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("TVM_LAYERFUSE_CACHE", str(tmp_path / "cache"))
    model = random_cnn(21, max_layers=4)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    result = tune_model(path, trials=4, tactics="tvm", progress=False)
    printed = capfd.readouterr()
    # MetaSchedule's log lines (Python handlers and C++ warnings) went to the debug log and its logs/ folder
    assert "[INFO]" not in printed.err + printed.out and "task_scheduler" not in printed.err + printed.out, printed.err[-500:]
    assert any((result.database / "logs").iterdir())
    assert result.tasks >= 1 and result.trials >= 1 and has_database(result.database)
    records = (result.database / "database_tuning_record.json").read_text().splitlines()
    assert records and all(json.loads(line) for line in records)
    out = compile_model(path, tmp_path / "art", tactics="tvm", progress=False)
    assert "JSONDatabase" not in capfd.readouterr().err  # the database is opened without TVM's warning line
    feeds = random_inputs(model, 3)
    for e, g in zip(run_onnxruntime(model, feeds), load(out).run(feeds).values()):
        assert rel_err(g, e) <= 1e-4
    np.testing.assert_equal(len(records) > 0, True)
    tuning = json.loads((out / "manifest.json").read_text())["tuning"]  # the manifest says what was applied
    assert tuning == {"database": str(result.database), "records": len(records), "workloads": len({json.loads(r)[0] for r in records})}
    schedules = json.loads((out / "manifest.json").read_text())["schedules"]  # the tuned kernels keep their schedules
    from_db = [k for k, v in schedules["kernels"].items() if v["rule"] == "metaschedule" or v["rule"].endswith("(tuning database)")]
    assert len(from_db) >= 1 and schedules["unscheduled"] == [], schedules["counts"]
    plain = compile_model(path, tmp_path / "plain", tactics="tvm", fuse=False, progress=False)
    assert json.loads((plain / "manifest.json").read_text())["tuning"] is None  # TVM's own pipeline: untuned


def test_missing_cost_model_is_refused_before_any_work(tmp_path, monkeypatch):
    """Without xgboost MetaSchedule fails only after its first round of measurements (minutes
    in); tune refuses at once, in one line naming the package and the install command."""
    import sys

    monkeypatch.setitem(sys.modules, "xgboost", None)  # `import xgboost` raises ImportError
    with pytest.raises(UsageError) as e:
        tune_model(tmp_path / "unused.onnx")
    assert "xgboost" in str(e.value) and "pip install xgboost-cpu" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_tune_measures_on_the_boards_of_a_tracker(tmp_path, monkeypatch):
    """--tracker: MetaSchedule's RPC runner asks a real tracker for a board of the key and
    measures there (the server's log shows the uploaded candidates being loaded)."""
    from tvm_layerfuse.deploy import board

    monkeypatch.setenv("TVM_LAYERFUSE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.onnx"
    onnx.save(random_cnn(21, max_layers=4), str(path))
    with board.start_tracker(port=0) as tracker:
        with board.start_server(port=0, tracker=tracker.address, key="edge") as server:
            host, port = tracker.address
            result = tune_model(path, trials=4, tactics="tvm", progress=False, tracker=f"{host}:{port}", key="edge")
            served = server.log_path.read_text()
    assert result.trials >= 1 and has_database(result.database)
    records = [json.loads(line) for line in (result.database / "database_tuning_record.json").read_text().splitlines()]
    run_secs = [r[1][1] for r in records]  # [workload, [trace, run_secs, target, args_info]]
    assert any(s and all(float(t) < 1e9 for t in s) for s in run_secs), run_secs  # measured, not failed (1e10)
    assert "load_module" in served, served[-2000:]
    # the rules' schedules were measured on the board too, before the search, and stored
    seeded = [r for r in result.rule_records if r.stored]
    assert seeded and all(0 < r.seconds < 1e9 for r in seeded), result.rule_records
    assert sum("layerfuse.rule" in json.dumps(r[1][0]) for r in records) >= len(seeded)


@pytest.mark.slow
def test_budget_ends_the_run_and_keeps_its_records(tmp_path, monkeypatch):
    """--budget: once it is spent, every task still running is terminated (once: TVM's check
    fails on a second termination) and the records measured so far stay in the database."""
    monkeypatch.setenv("TVM_LAYERFUSE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.onnx"
    onnx.save(random_cnn(0, max_layers=6), str(path))  # 2 convs, a pool, a gate: several tasks
    result = tune_model(path, trials=64, budget=0.001, tactics="tvm", progress=False)
    assert result.tasks >= 2, "the model must give several tasks, so that more batches come back after the budget"
    assert 1 <= result.trials < 64 and has_database(result.database)
