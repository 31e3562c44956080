"""The CPU's few-row linear op (:mod:`kernels.cpu_linear`): each form (weight-left, oneDNN on a
packed weight) the same products as ``F.linear`` at every row count, shape and dtype; the form
each row count runs, as the probe or ``ASYMCACHE_CPU_LINEAR`` chose it; and the op the CPU
engine's dispatch picks."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_linear
from kernels.batch_invariant import linear_naive, linear_padded
from kernels.cpu_linear import (
    FEW_ROWS,
    FORM_ENV,
    ROW_BUCKETS,
    choose_forms,
    few_row_forms,
    linear_cpu,
    linear_invariant_cpu,
    linear_onednn,
    linear_weight_left,
    onednn_available,
    onednn_weight,
    packed_weight_bytes,
    pick_form,
    probe_forms,
    row_bucket,
)
from kernels.dispatch import (
    CPU_DENSE_OPS,
    DEFAULT_DENSE_OPS,
    select_attention_backend,
    select_dense_ops,
)


@pytest.fixture(autouse=True)
def two_threads():
    """The op takes its own path only with two or more threads (the test workers run one)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear op")
FEW_ROW_FORMS = ["weight-left", pytest.param("onednn", marks=needs_onednn)]


@pytest.mark.parametrize("form", FEW_ROW_FORMS)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 7, 16, FEW_ROWS - 1, FEW_ROWS, 100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_each_form_matches_the_float64_product(form: str, rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn((960, 576), generator=gen) / 24
    bias = torch.randn(960, generator=gen) if with_bias else None
    x = torch.randn((rows, 576), generator=gen)
    out = cpu_linear.FORM_OPS[form](x, weight, bias)
    assert out.shape == (rows, 960) and out.is_contiguous() and out.dtype == torch.float32
    ref = linear_naive(x.double(), weight.double(), None if bias is None else bias.double())
    err = (out.double() - ref).abs()
    assert err.numel() == 0 or float(err.max()) < 1e-4
    # the same float32 product as the library's, up to summation order
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", FEW_ROW_FORMS)
def test_each_form_keeps_leading_dims_strided_and_empty_input(form: str) -> None:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn((192, 64), generator=gen)
    x = torch.randn((2, 3, 128), generator=gen)[..., ::2]  # [2, 3, 64], last dim strided
    out = cpu_linear.FORM_OPS[form](x, weight)
    assert out.shape == (2, 3, 192)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert cpu_linear.FORM_OPS[form](x[:0], weight).shape == (0, 3, 192)


def test_weight_left_leaves_other_dtypes_many_rows_and_long_single_rows_to_the_library() -> None:
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn((256, 128), generator=gen)
    for x, w in (
        (torch.randn((4, 128), generator=gen).bfloat16(), weight.bfloat16()),
        (torch.randn((FEW_ROWS + 5, 128), generator=gen), weight),
        # one row against a weight no wider than long: BLAS's matrix-vector kernel
        (torch.randn((1, 256), generator=gen), weight.T.contiguous()),
    ):
        assert torch.equal(linear_weight_left(x, w), F.linear(x, w))


def test_weight_left_is_the_library_on_one_thread() -> None:
    gen = torch.Generator().manual_seed(5)
    weight, x = torch.randn((3072, 576), generator=gen), torch.randn((4, 576), generator=gen)
    two = linear_weight_left(x, weight)
    torch.set_num_threads(1)
    assert torch.equal(linear_weight_left(x, weight), F.linear(x, weight))
    assert torch.equal(two, (weight @ x.T).T)  # on two threads: the weight-left product


@needs_onednn
def test_onednn_leaves_other_dtypes_to_the_library() -> None:
    gen = torch.Generator().manual_seed(7)
    x, weight = torch.randn((3, 64), generator=gen).bfloat16(), torch.randn((192, 64), generator=gen).bfloat16()
    assert torch.equal(linear_onednn(x, weight), F.linear(x, weight))


@needs_onednn
def test_a_weight_is_packed_once_and_again_after_it_changes() -> None:
    gen = torch.Generator().manual_seed(8)
    weight, x = torch.randn((256, 128), generator=gen), torch.randn((3, 128), generator=gen)
    first = onednn_weight(weight)
    assert onednn_weight(weight) is first  # cached on the tensor: engines sharing weights share it
    before = linear_onednn(x, weight)
    with torch.no_grad():
        weight.mul_(2.0)  # in place: a new version of the same storage
    assert onednn_weight(weight) is not first
    torch.testing.assert_close(linear_onednn(x, weight), 2.0 * before, rtol=1e-5, atol=1e-5)


def test_each_row_count_runs_the_form_chosen_for_its_bucket(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    assert [row_bucket(r) for r in (1, 2, 3, 4, 7, 8, 15, 16, FEW_ROWS - 1, FEW_ROWS, 500)] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn((3072, 576), generator=gen)
    forms = [f for f in cpu_linear.FORMS if f != "onednn" or onednn_available()]
    for rows in (1, 2, 5, 9, 20, 40):
        x = torch.randn((rows, 576), generator=gen)
        outputs = {f: cpu_linear.FORM_OPS[f](x, weight) for f in forms}
        for form in forms:
            chosen = ["library"] * len(ROW_BUCKETS)
            chosen[row_bucket(rows)] = form
            monkeypatch.setattr(cpu_linear, "few_row_forms", lambda threads, c=tuple(chosen): c)
            assert torch.equal(linear_cpu(x, weight), outputs[form]), (rows, form)
    # other dtypes and empty inputs are the library's whatever the choice
    monkeypatch.setattr(cpu_linear, "few_row_forms", lambda threads: ("onednn",) * len(ROW_BUCKETS))
    x = torch.randn((2, 576), generator=gen)
    assert torch.equal(linear_cpu(x.bfloat16(), weight.bfloat16()), F.linear(x.bfloat16(), weight.bfloat16()))
    assert linear_cpu(x[:0], weight).shape == (0, 3072)


def test_the_cpu_engine_runs_the_few_row_op() -> None:
    assert select_dense_ops("cpu") is CPU_DENSE_OPS and CPU_DENSE_OPS.linear is linear_cpu
    assert select_dense_ops("meta") is DEFAULT_DENSE_OPS
    for preference in ("torch", "naive"):
        assert select_attention_backend("cpu", preference, torch.float32).dense is CPU_DENSE_OPS
    # the batch-invariant mode runs its own op (a row's bits must not follow the batch)
    assert select_attention_backend("cpu", "torch", torch.float32, batch_invariant=True).dense.linear is linear_invariant_cpu


def test_another_form_is_taken_only_past_the_margin() -> None:
    assert pick_form({"library": 1.0, "weight-left": 0.5}) == "weight-left"
    assert pick_form({"library": 1.0, "weight-left": 0.9, "onednn": 0.1}) == "library"  # oneDNN: all or none
    assert pick_form({"library": 1.2, "weight-left": 1.0}) == "library"
    assert pick_form({"library": 0.3, "weight-left": 0.8}) == "library"


def _probe(few: dict[str, float], many: dict[str, float]) -> dict[int, dict[str, float]]:
    return {rows: dict(few if rows < FEW_ROWS else many) for rows in cpu_linear.PROBE_ROWS}


def test_onednn_is_taken_for_every_row_count_or_none() -> None:
    # clearly faster at few rows and as fast at many: every bucket, many rows included
    both = _probe({"library": 1.0, "weight-left": 0.9, "onednn": 0.5}, {"library": 4.0, "onednn": 4.2})
    assert choose_forms(both) == ("onednn",) * len(ROW_BUCKETS)
    # slower at many rows (prefill steps): none, the few-row buckets pick among the others
    slow_many = _probe({"library": 1.0, "weight-left": 0.5, "onednn": 0.3}, {"library": 4.0, "onednn": 5.0})
    assert choose_forms(slow_many) == ("weight-left",) * (len(ROW_BUCKETS) - 1) + ("library",)
    # not clearly faster than what the few rows would run instead
    close = _probe({"library": 1.0, "onednn": 0.95}, {"library": 4.0, "onednn": 4.0})
    assert choose_forms(close) == ("library",) * len(ROW_BUCKETS)
    # a machine without oneDNN's op
    assert choose_forms(_probe({"library": 1.0}, {"library": 4.0})) == ("library",) * len(ROW_BUCKETS)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_probe_times_every_form_that_can_run(threads: int) -> None:
    probe = probe_forms(threads, rounds=1)
    assert sorted(probe) == sorted(cpu_linear.PROBE_ROWS)
    onednn = {"onednn"} if onednn_available() else set()
    for rows, times in probe.items():
        left = {"weight-left"} if threads >= 2 and rows < FEW_ROWS else set()
        assert set(times) == {"library"} | left | onednn and all(t > 0 for t in times.values())


@pytest.fixture
def fresh_forms(monkeypatch):  # type: ignore[no-untyped-def]
    """``few_row_forms`` with an empty cache, and emptied again after the test."""
    few_row_forms.cache_clear()
    yield monkeypatch
    few_row_forms.cache_clear()


def test_the_env_variable_sets_one_form_for_every_row_count(fresh_forms) -> None:  # type: ignore[no-untyped-def]
    fresh_forms.setenv(FORM_ENV, "library")
    assert few_row_forms(2) == ("library",) * len(ROW_BUCKETS)
    few_row_forms.cache_clear()
    fresh_forms.setenv(FORM_ENV, "weight-left")  # below FEW_ROWS rows: from there it is the library's
    assert few_row_forms(2) == ("weight-left",) * (len(ROW_BUCKETS) - 1) + ("library",)
    few_row_forms.cache_clear()
    fresh_forms.setenv(FORM_ENV, "fastest")
    with pytest.raises(ValueError, match=FORM_ENV):
        few_row_forms(2)
    few_row_forms.cache_clear()
    fresh_forms.setenv(FORM_ENV, "onednn")
    if onednn_available():
        assert few_row_forms(1) == ("onednn",) * len(ROW_BUCKETS)
    else:
        with pytest.raises(ValueError, match="oneDNN"):
            few_row_forms(1)


def test_the_packed_copies_are_counted_once_a_weight_where_onednn_runs(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    model = torch.nn.ModuleList([torch.nn.Linear(64, 32), torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)])
    model[2].weight = model[0].weight  # shared by two layers, as a tied head is: packed once
    monkeypatch.setattr(cpu_linear, "few_row_forms", lambda threads: ("library",) * len(ROW_BUCKETS))
    assert packed_weight_bytes(model, 1) == 0
    monkeypatch.setattr(cpu_linear, "few_row_forms", lambda threads: ("onednn",) * len(ROW_BUCKETS))
    assert packed_weight_bytes(model, 1) == 2 * 64 * 32 * 4


def test_a_machines_forms_are_probed_once_and_kept(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    probes: list[int] = []

    def fake_probe(threads: int, rounds: int = 3) -> dict[int, dict[str, float]]:
        probes.append(threads)
        return _probe({"library": 1.0, "weight-left": 0.5}, {"library": 4.0})

    monkeypatch.setattr(cpu_linear, "probe_forms", fake_probe)
    store = tmp_path / "cache" / cpu_linear.STORE_NAME
    expected = ("weight-left",) * (len(ROW_BUCKETS) - 1) + ("library",)
    assert cpu_linear.stored_forms(2, store) == expected and probes == [2]
    assert cpu_linear.stored_forms(2, store) == expected and probes == [2]  # read back, not probed
    assert cpu_linear.stored_forms(1, store) == expected and probes == [2, 1]  # another thread count
    # a store that names no form, or cannot be parsed, is probed over
    data = json.loads(store.read_text())
    data[cpu_linear.machine_key(2)] = ["fastest"] * len(ROW_BUCKETS)
    store.write_text(json.dumps(data))
    assert cpu_linear.stored_forms(2, store) == expected and probes == [2, 1, 2]
    store.write_text("{not json")
    assert cpu_linear.stored_forms(2, store) == expected and probes == [2, 1, 2, 2]
    # no store: a probe every call
    assert cpu_linear.stored_forms(2, None) == expected and probes == [2, 1, 2, 2, 2]


def test_few_row_forms_keep_the_probe_in_the_cache_folder(fresh_forms, tmp_path) -> None:  # type: ignore[no-untyped-def]
    fresh_forms.delenv(FORM_ENV, raising=False)
    fresh_forms.setenv("ASYMCACHE_CACHE_DIR", str(tmp_path))
    fresh_forms.setattr(cpu_linear, "probe_forms", lambda threads, rounds=3: _probe({"library": 1.0}, {"library": 4.0}))
    assert few_row_forms(2) == ("library",) * len(ROW_BUCKETS)
    kept = json.loads((tmp_path / cpu_linear.STORE_NAME).read_text())
    assert kept == {cpu_linear.machine_key(2): ["library"] * len(ROW_BUCKETS)}


@pytest.fixture
def fresh_checks(monkeypatch, tmp_path):  # type: ignore[no-untyped-def]
    """``onednn_rows_invariant`` with an empty cache and store, emptied again after the test."""
    monkeypatch.setenv("ASYMCACHE_CACHE_DIR", str(tmp_path))
    cpu_linear.onednn_rows_invariant.cache_clear()
    yield monkeypatch
    cpu_linear.onednn_rows_invariant.cache_clear()


@pytest.mark.parametrize("with_bias", [False, True])
def test_the_invariant_op_gives_a_row_its_bits_in_any_batch(fresh_checks, with_bias: bool) -> None:  # type: ignore[no-untyped-def]
    # whichever product this machine's check allows: a row's bits alone, in a few rows, in many
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn((320, 192), generator=gen) / 14
    bias = torch.randn(320, generator=gen) if with_bias else None
    x = torch.randn((300, 192), generator=gen)
    full = linear_invariant_cpu(x, weight, bias)
    for rows in (1, 2, 3, 5, 17, 64, 299):
        assert torch.equal(linear_invariant_cpu(x[:rows], weight, bias), full[:rows]), rows
        assert torch.equal(linear_invariant_cpu(x[-rows:], weight, bias), full[-rows:]), rows
    exact = linear_naive(x.double(), weight.double(), None if bias is None else bias.double())
    torch.testing.assert_close(full.double(), exact, rtol=1e-5, atol=1e-5)


def test_a_product_whose_rows_follow_the_batch_fails_the_check(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(cpu_linear, "onednn_available", lambda: True)

    def uneven(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = (x.double() @ weight.double().T).float()  # each row alone, whatever the call
        return out * (1 + 1e-6) if x.shape[0] == 64 else out  # but a blocking that changes at 64 rows

    monkeypatch.setattr(cpu_linear, "linear_onednn", uneven)
    assert cpu_linear.onednn_rows_agree(48, 32) is False
    assert cpu_linear.onednn_rows_agree(48, 32, rows=(1, 2, 63, 65)) is True  # the counts checked are what it saw
    monkeypatch.setattr(cpu_linear, "onednn_available", lambda: False)
    assert cpu_linear.onednn_rows_agree(48, 32) is False  # no oneDNN: nothing to check


@needs_onednn
def test_the_check_is_kept_per_shape_and_a_failed_one_runs_padded_calls(fresh_checks, tmp_path) -> None:  # type: ignore[no-untyped-def]
    checks: list[tuple[int, int]] = []

    def fake_check(out_features: int, in_features: int) -> bool:
        checks.append((out_features, in_features))
        return out_features != 96  # one shape's rows follow the batch on this "machine"

    fresh_checks.setattr(cpu_linear, "onednn_rows_agree", fake_check)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn((5, 32), generator=gen)
    failed, passed = torch.randn((96, 32), generator=gen), torch.randn((48, 32), generator=gen)
    assert torch.equal(linear_invariant_cpu(x, failed), linear_padded(x, failed))
    assert torch.equal(linear_invariant_cpu(x, passed), linear_onednn(x, passed))
    linear_invariant_cpu(x[:0], passed)  # an empty batch asks nothing
    assert checks == [(96, 32), (48, 32)]
    kept = json.loads((tmp_path / cpu_linear.STORE_NAME).read_text())
    assert kept[f"{cpu_linear.machine_key(2)}|onednn-rows|96x32"] is False
    cpu_linear.onednn_rows_invariant.cache_clear()  # a new process: read back, not checked again
    linear_invariant_cpu(x, failed)
    assert len(checks) == 2


@needs_onednn
def test_the_check_runs_from_inside_inference_mode() -> None:
    # the engine's first forward step asks for it there: the check's tensors are its own
    with torch.inference_mode():
        assert cpu_linear.onednn_rows_agree(48, 32, rows=(1, 2, 5)) in (True, False)
