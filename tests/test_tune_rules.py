"""tune starts from the schedule rules: each task's rule schedule is measured and stored as a
tuning record before the search, and ``compile`` applies the fastest record of each kernel
(the rule's own when nothing measured faster). Structural checks only, no timings."""

import json
import shutil

import onnx
import pytest

from graphs import rel_err
from tvm_layerfuse.compile.build import compile_model
from tvm_layerfuse.compile.presets import resolve
from tvm_layerfuse.compile.schedules.apply import FROM_DATABASE, RULE_MARK, TUNED
from tvm_layerfuse.compile.tune import NOT_REPLAYED, TuneResult, _replays, compile_module, measurers, seed_rule_records, tune_model
from tvm_layerfuse.compile.tune_database import database_dir
from tvm_layerfuse.lowering import LayerfusePipeline
from tvm_layerfuse.runtime import load
from tvm_layerfuse.testing import random_inputs, run_onnxruntime
from tvm_layerfuse.testing._builder import NetBuilder


def _one_conv() -> onnx.ModelProto:
    """One conv of as many channels as this CPU has fp32 lanes: it runs blocked (NCHW[x]c),
    so the module has layout transforms beside it to tune."""
    from tvm_layerfuse.compile.schedules import CPUParams

    lanes = CPUParams.of(resolve("cpu").tvm_target()).lanes
    b = NetBuilder("tune_rules", seed=11)
    x = b.input("x", (1, lanes, 10, 10))
    return b.build([b.relu(b.conv(x, lanes, 3, pad=1))])


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A one-conv model (``--tactics tvm``) whose database holds what ``tune`` stores before
    its search: every task's rule schedule, built and measured here (the search itself, which
    costs MetaSchedule's import of every tensor intrinsic, runs in the slow test below).
    (model path, cache folder, TuneResult)."""
    import tvm.s_tir.meta_schedule as ms

    root = tmp_path_factory.mktemp("tune_rules")
    path = root / "m.onnx"
    onnx.save(_one_conv(), str(path))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TVM_LAYERFUSE_CACHE", str(root / "cache"))
        db_dir = database_dir(resolve("cpu").target, resolve("cpu").host)
    db_dir.mkdir(parents=True)
    tasks, _, tgt = _tasks(path, raw=True)
    builder, runner = measurers()
    db = ms.database.JSONDatabase(work_dir=str(db_dir), allow_missing=True)
    seeded = seed_rule_records(tasks, db, target=tgt, builder=builder, runner=runner)
    return path, root / "cache", TuneResult(database=db_dir, tasks=len(tasks), trials=0, seconds=0.0, rule_records=seeded)


def _tasks(path, *, raw: bool = False):
    """({kernel name: its workload module, as MetaSchedule tunes it} - or MetaSchedule's tasks
    themselves with ``raw`` -, the Relax module ``compile`` lowers, the tuning target)."""
    import tvm
    import tvm.s_tir.meta_schedule as ms

    mod, tgt = compile_module(onnx.load(str(path)), resolve("cpu"), tactics="tvm")
    with tgt:
        lowered = tvm.transform.Sequential(LayerfusePipeline(tgt, stop_after="NarrowBlockedIndices").passes())(mod)
    tasks = ms.relax_integration.extract_tasks(lowered, tgt)
    return (tasks if raw else {t.task_name: t.dispatched[0] for t in tasks}), mod, tgt


def _records(db, workload) -> list:
    import tvm

    def same(a, b) -> bool:
        try:
            tvm.ir.assert_structural_equal(a, b)
        except ValueError:
            return False
        return True

    return [r for r in db.get_all_tuning_records() if same(r.workload.mod, workload)]


def _mean(record) -> float:
    return sum(float(x) for x in record.run_secs) / len(record.run_secs)


def _bare(func):
    for key in list(func.attrs.keys()) if func.attrs is not None else []:
        func = func.without_attr(key)
    return func


def _replayed(workload, record):
    from tvm import s_tir

    sch = s_tir.Schedule(workload)
    record.trace.apply_to_schedule(sch, remove_postproc=False)
    return sch.mod["main"]


def _applied(mod, tgt, db_dir):
    """(each kernel as ``compile`` schedules it with the database, the schedule report)."""
    from tvm import tirx

    pipe = LayerfusePipeline(tgt, database=str(db_dir), stop_after="LayerfuseSchedules")
    out = pipe(mod)
    funcs = {gv.name_hint: f for gv, f in out.functions_items() if isinstance(f, tirx.PrimFunc)}
    return funcs, pipe.schedule_report


def _check_fastest_applied(path, db_dir):
    """Every task's applied kernel is its fastest record replayed on the workload; returns
    {kernel: (the fastest record, reported rule)}."""
    import tvm
    import tvm.s_tir.meta_schedule as ms

    tasks, mod, tgt = _tasks(path)
    db = ms.database.JSONDatabase(work_dir=str(db_dir), allow_missing=False)
    applied, report = _applied(mod, tgt, db_dir)
    best = {}
    for name, workload in tasks.items():
        records = [r for r in _records(db, workload) if r.run_secs and max(float(x) for x in r.run_secs) < 1e9]
        if not records:  # not tuned: the rule schedules it in compile
            rule = report.kernels[name].rule
            assert rule not in (None, TUNED) and not rule.endswith("(tuning database)"), (name, rule)
            best[name] = (None, rule)
            continue
        fastest = min(records, key=_mean)
        tvm.ir.assert_structural_equal(_bare(applied[name]), _bare(_replayed(workload, fastest)))
        best[name] = (fastest, report.kernels[name].rule)
    return best


def test_the_rules_schedule_is_the_first_record_and_the_fastest_record_is_applied(tuned):
    best = _check_rule_records_and_fastest_applied(*tuned)
    # before any search every task's fastest record is the rule's own
    assert all(rule.endswith("(tuning database)") for record, rule in best.values() if record is not None), best


@pytest.mark.slow
def test_tune_with_two_trials_keeps_the_rules_record(tmp_path, monkeypatch):
    """The whole ``tune``: the rules' records go in first, MetaSchedule's search (2 trials)
    adds its own, and compile applies the fastest record of each kernel."""
    monkeypatch.setenv("TVM_LAYERFUSE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.onnx"
    onnx.save(_one_conv(), str(path))
    result = tune_model(path, trials=2, tactics="tvm", progress=False)
    untuned = sum(r.note == NOT_REPLAYED for r in result.rule_records)
    assert result.trials >= 1 and result.tasks == len(result.rule_records) - untuned
    _check_rule_records_and_fastest_applied(path, tmp_path / "cache", result)


def _check_rule_records_and_fastest_applied(path, cache, result):
    """The rule's record is there for every task (the conv's from a conv rule), measured;
    each kernel compile builds is its fastest record, reported truthfully."""
    conv = [r for r in result.rule_records if "conv2d" in r.task]
    assert len(conv) == 1 and conv[0].rule.startswith("conv2d"), result.rule_records
    # every rule schedule is stored, measured, unless its trace cannot replay (then the kernel is not tuned)
    assert all(r.stored and r.seconds > 0 for r in result.rule_records if r.note != NOT_REPLAYED), result.rule_records
    assert sum(r.stored for r in result.rule_records) >= 2, result.rule_records
    best = _check_fastest_applied(path, result.database)
    for name, (record, rule) in best.items():
        if record is None:
            continue
        marked = RULE_MARK in str(record.trace)
        expected_rule = next(r.rule for r in result.rule_records if r.task == name)
        # the report says truthfully where the kernel's schedule came from
        assert rule == (FROM_DATABASE.format(rule=expected_rule) if marked else TUNED), (name, rule)
    import tvm.s_tir.meta_schedule as ms

    tasks, _, _ = _tasks(path)
    db = ms.database.JSONDatabase(work_dir=str(result.database), allow_missing=False)
    for name, workload in tasks.items():  # the rule's record is there for every task, measured
        if any(r.task == name and r.note == NOT_REPLAYED for r in result.rule_records):
            assert not _records(db, workload), name  # and such a task is not searched
            continue
        rule_records = [r for r in _records(db, workload) if RULE_MARK in str(r.trace)]
        assert rule_records and all(0 < _mean(r) < 1e9 for r in rule_records), name
    return best


def test_a_second_run_does_not_store_the_rules_schedule_again(tuned):
    import tvm.s_tir.meta_schedule as ms

    path, _, result = tuned
    tasks, _, tgt = _tasks(path)
    before = (result.database / "database_tuning_record.json").read_text()
    db = ms.database.JSONDatabase(work_dir=str(result.database), allow_missing=False)

    class _Tasks:  # what seed_rule_records reads of MetaSchedule's ExtractedTask
        def __init__(self, name, mod):
            self.task_name, self.dispatched = name, [mod]

    # nothing is left to measure, so neither a builder nor a runner is needed
    again = seed_rule_records([_Tasks(n, m) for n, m in tasks.items()], db, target=tgt, builder=None, runner=None)
    first = {r.task: r.note for r in result.rule_records}
    assert [r.note for r in again] == [first[r.task] or "already in the database" for r in again], again
    assert "already in the database" in [r.note for r in again]
    assert (result.database / "database_tuning_record.json").read_text() == before


def test_a_faster_searched_record_wins_over_the_rules(tuned, tmp_path, monkeypatch):
    """A record that is not the rule's, stored with a shorter time than the rule's, is what
    compile applies (reported as ``metaschedule``), and the model stays correct. (A record of
    TVM's default design space would need a TuneContext, which imports every tensor
    intrinsic: minutes on a loaded machine; a hand-written schedule stands for it.)"""
    import tvm.s_tir.meta_schedule as ms
    from tvm import s_tir

    from tvm_layerfuse.compile.schedules.base import iter_kinds

    path, cache, result = tuned
    shutil.copytree(cache, tmp_path / "cache")
    monkeypatch.setenv("TVM_LAYERFUSE_CACHE", str(tmp_path / "cache"))
    db_dir = database_dir(resolve("cpu").target, resolve("cpu").host)
    assert db_dir.is_dir() and db_dir != result.database
    tasks, _, tgt = _tasks(path)
    name, workload = next((n, w) for n, w in tasks.items() if "conv2d" in n)
    db = ms.database.JSONDatabase(work_dir=str(db_dir), allow_missing=False)
    fastest = min((_mean(r) for r in _records(db, workload)), default=2e-6)
    # a schedule the search could have found: the conv's output rows in parallel, nothing else
    space = s_tir.Schedule(workload)
    root = space.get_sblock("root", func_name="main")
    conv = next(b for b in space.get_child_blocks(root) if "R" in iter_kinds(space, b))
    space.parallel(space.get_loops(conv)[2])
    db.commit_tuning_record(
        ms.database.TuningRecord(
            space.trace,
            db.commit_workload(workload),
            run_secs=[fastest / 2],
            target=tgt,
            args_info=ms.arg_info.ArgInfo.from_prim_func(workload["main"]),
        )
    )
    best = _check_fastest_applied(path, db_dir)
    assert RULE_MARK not in str(best[name][0].trace) and best[name][1] == TUNED, best[name]
    out = compile_model(path, tmp_path / "art", tactics="tvm", progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["schedules"]["kernels"][name]["rule"] == TUNED, manifest["schedules"]["kernels"]
    model = onnx.load(str(path))
    feeds = random_inputs(model, 5)
    for e, g in zip(run_onnxruntime(model, feeds), load(out).run(feeds).values()):
        assert rel_err(g, e) <= 1e-4


def test_a_trace_is_stored_only_if_it_replays_on_its_workload(tuned):
    """The check that keeps a rule step MetaSchedule could not re-apply out of the database:
    a layout transform's rule trace replays on its workload, not on the conv's."""
    from tvm_layerfuse.compile.schedules.apply import rule_schedule
    from tvm_layerfuse.compile.schedules.base import CPUParams

    path, _, _ = tuned
    tasks, _, tgt = _tasks(path)
    conv = next(w for n, w in tasks.items() if "conv2d" in n)
    other = next(w for n, w in tasks.items() if "conv2d" not in n)
    sch, rule = rule_schedule(other["main"], CPUParams.of(tgt), tgt)
    assert rule is not None and len(sch.trace.insts) > 2
    assert _replays(sch, other)
    assert not _replays(sch, conv)


def test_the_conv_rules_schedule_is_a_record(tuned):
    _, _, result = tuned
    conv = next(r for r in result.rule_records if "conv2d" in r.task)
    assert conv.stored, conv
