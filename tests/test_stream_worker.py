"""The host worker of stream-ordered expert calls (host_kernels/csrc/stream_worker.c), driven without a GPU: a
thread plays the device side (fills the staging buffers, posts the go, waits for the done) against the real worker
and the fused forward; and the CUDA handlers that drive it on a GPU, compiled against the pip CUDA headers."""

import importlib.util
import subprocess
import sysconfig
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from host_kernels import StreamWorker, native
from host_kernels.fused_forward import BACKWARD_KERNELS, FusedForward, best_kernel, pack_layer
from host_kernels.host_moe import HostMoE
from host_kernels.native_sources import CSRC, CUDA_SOURCES
from host_kernels.stream_worker import (
    BACKWARD,
    FAILED,
    FORWARD_KEEPING,
    SLOTS,
    STOPPED,
    TIMED_OUT,
    UNKNOWN_SITE,
    cuda_status,
)
from tests.test_fused_forward import BF16, make_store, routing

HIDDEN, EXPERTS, TOP_K = 96, 8, 2
KERNEL, WHY = best_kernel(np.float32)
pytestmark = pytest.mark.skipif(not KERNEL, reason=f"no fused forward kernel for float32 here: {WHY}")


@pytest.fixture(scope="module")
def fused():
    store = make_store(experts=EXPERTS, hidden=HIDDEN, dtype=np.float32)
    fused = FusedForward(store, lambda layer: pack_layer(store[layer], KERNEL), threads=2, kernel=KERNEL)
    fused.prepare(store.layers)
    return fused


class Device:
    """The device side of the protocol, as a GPU stream would run it: copies in, go, wait, copy out."""

    def __init__(self, worker: StreamWorker, fused: FusedForward):
        self.worker, self.fused = worker, fused

    def submit(self, layer, slot, x, ids, weights) -> int:
        tokens = x.shape[0]
        site = self.worker.site(self.fused.call_address(layer), layer, slot, tokens, HIDDEN, TOP_K, x.dtype, np.float32)
        x_in, ids_in, weights_in, _ = self.worker.staging(site, tokens, HIDDEN, TOP_K, x.dtype, np.float32)
        x_in[...], ids_in[...], weights_in[...] = x, ids, weights
        self.worker.post(site)
        return site

    def sync(self, site, tokens, timeout_s=30.0):
        status = self.worker.wait(site, timeout_s)
        y = self.worker.staging(site, tokens, HIDDEN, TOP_K, np.float32, np.float32)[3].copy()
        return status, y


def inputs(rng, tokens):
    x = rng.standard_normal((tokens, HIDDEN)).astype(np.float32)
    if not tokens:
        return x, np.zeros((0, TOP_K), np.int32), np.zeros((0, TOP_K), np.float32)
    ids, weights = routing(rng, tokens, EXPERTS, TOP_K)
    return x, ids, weights


def on_device_thread(fn):
    """Runs fn() on another thread (the device side) and returns its result or raises its error."""
    result, error = [], []
    thread = threading.Thread(target=lambda: _capture(fn, result, error))
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the device side hung"
    if error:
        raise error[0]
    return result[0]


def _capture(fn, result, error):
    try:
        result.append(fn())
    except BaseException as e:  # handed back to the test's thread
        error.append(e)


@pytest.mark.parametrize("tokens", [0, 1, 7, 300])
def test_results_equal_the_direct_forward(fused, tokens):
    worker = StreamWorker()
    device = Device(worker, fused)
    rng = np.random.default_rng(tokens)
    calls = [(layer, *inputs(rng, tokens)) for layer in (0, 1, 0)]

    def run():
        return [device.sync(device.submit(layer, i, x, ids, w), tokens) for i, (layer, x, ids, w) in enumerate(calls)]

    for (layer, x, ids, w), (status, y) in zip(calls, on_device_thread(run), strict=True):
        assert status == 0
        np.testing.assert_array_equal(y, fused.forward(layer, x, ids, w))
    assert worker.counters()["calls"] == 3
    assert worker.take_error() is None


def test_every_slot_in_flight_at_once(fused):
    worker = StreamWorker()
    device = Device(worker, fused)
    rng = np.random.default_rng(1)
    calls = [(slot % 2, *inputs(rng, 3 + slot)) for slot in range(SLOTS)]

    def run():
        sites = [device.submit(layer, slot, x, ids, w) for slot, (layer, x, ids, w) in enumerate(calls)]
        return [device.sync(site, x.shape[0]) for site, (_, x, _, _) in zip(sites, calls, strict=True)]

    for (layer, x, ids, w), (status, y) in zip(calls, on_device_thread(run), strict=True):
        assert status == 0
        np.testing.assert_array_equal(y, fused.forward(layer, x, ids, w))
    # the same sites again: made once, their staging reused
    sites_before = worker.counters()["sites"]
    on_device_thread(run)
    assert worker.counters()["sites"] == sites_before == SLOTS


def test_several_device_threads(fused):
    worker = StreamWorker()
    device = Device(worker, fused)
    rng = np.random.default_rng(2)
    work = {slot: [inputs(rng, 5) for _ in range(20)] for slot in range(4)}
    results = {}

    def lane(slot):
        results[slot] = [device.sync(device.submit(slot % 2, slot, *call), 5) for call in work[slot]]

    threads = [threading.Thread(target=lane, args=(slot,)) for slot in work]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    for slot, calls in work.items():
        for (x, ids, w), (status, y) in zip(calls, results[slot], strict=True):
            assert status == 0
            np.testing.assert_array_equal(y, fused.forward(slot % 2, x, ids, w))


def test_a_failed_call_reaches_the_caller_by_layer(fused):
    worker = StreamWorker()
    device = Device(worker, fused)
    x, ids, w = inputs(np.random.default_rng(3), 4)
    ids[2, 1] = EXPERTS + 5  # no such expert: the fused forward refuses it
    status, y = on_device_thread(lambda: device.sync(device.submit(1, 0, x, ids, w), 4))
    assert status == FAILED
    assert np.isnan(y).all()  # nothing downstream mistakes it for a result
    error = worker.take_error()
    assert error.layer == 1 and str(EXPERTS + 5) in error.message
    assert worker.take_error() is None  # taken
    ids[2, 1] = 0  # the worker goes on serving
    status, y = on_device_thread(lambda: device.sync(device.submit(1, 0, x, ids, w), 4))
    assert status == 0
    np.testing.assert_array_equal(y, fused.forward(1, x, ids, w))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(slot=SLOTS), "slot 8 is not in"),
        (dict(slot=-1), "slot -1"),
        (dict(tokens=-1), "cannot be staged"),
        (dict(top_k=0), "cannot be staged"),
        (dict(x_dtype=np.int32), "float32 or bfloat16"),
        (dict(call=0), "no moe_call"),
    ],
)
def test_malformed_sites_are_refused_by_name(fused, change, message):
    worker = StreamWorker()
    args = dict(call=fused.call_address(0), layer=0, slot=0, tokens=3, hidden=HIDDEN, top_k=TOP_K)
    args.update(x_dtype=np.float32, w_dtype=np.float32)
    args.update(change)
    with pytest.raises(Exception, match=message):
        worker.site(args.pop("call"), *args.values())


def test_a_wrong_hidden_size_fails_the_call_not_the_process(fused):
    worker = StreamWorker()
    site = worker.site(fused.call_address(0), 0, 0, 2, HIDDEN + 1, TOP_K, np.float32, np.float32)
    worker.post(site)
    assert worker.wait(site, 30) == FAILED
    error = worker.take_error()
    assert error.layer == 0 and "97 columns" in error.message


def test_waits_time_out_and_unknown_sites_are_named(fused):
    worker = StreamWorker()
    site = worker.site(fused.call_address(0), 0, 0, 1, HIDDEN, TOP_K, np.float32, np.float32)
    start = time.perf_counter()
    assert worker.wait(site, 0.05) == TIMED_OUT  # never posted
    assert time.perf_counter() - start < 5
    assert worker.wait(site + 1000, 0.05) == UNKNOWN_SITE


def test_stopping_while_calls_wait_ends_every_wait(fused):
    worker = StreamWorker()
    device = Device(worker, fused)
    rng = np.random.default_rng(4)
    calls = [inputs(rng, 300) for _ in range(SLOTS)]
    sites = [device.submit(slot % 2, slot, *call) for slot, call in enumerate(calls)]
    statuses = {}

    def wait_all():
        for slot, site in enumerate(sites):
            statuses[slot] = device.sync(site, 300)

    waiter = threading.Thread(target=wait_all)
    waiter.start()
    worker.stop()  # while the waiter waits on calls the worker has not reached
    waiter.join(60)
    assert not waiter.is_alive(), "a wait outlived the worker's stop"
    for slot, (status, y) in statuses.items():
        assert status in (0, STOPPED)
        if status == 0:
            np.testing.assert_array_equal(y, fused.forward(slot % 2, *calls[slot]))
    # after the stop: a post is answered at once, a new site refused
    worker.post(sites[0])
    assert worker.wait(sites[0], 5) == STOPPED
    with pytest.raises(Exception, match="stopped"):
        worker.site(fused.call_address(0), 0, 1, 9, HIDDEN, TOP_K, np.float32, np.float32)


def test_an_idle_worker_sleeps_and_wakes_for_a_post(fused):
    worker = StreamWorker(spin_us=100, poll_us=1000)
    device = Device(worker, fused)
    x, ids, w = inputs(np.random.default_rng(5), 2)
    time.sleep(0.2)
    sleeps = worker.counters()["sleeps"]
    assert 0 < sleeps < 1000  # asleep most of the time, looking every ~1 ms: not spinning
    status, y = on_device_thread(lambda: device.sync(device.submit(0, 3, x, ids, w), 2))
    assert status == 0
    np.testing.assert_array_equal(y, fused.forward(0, x, ids, w))


def test_staging_grows_without_moving_earlier_sites(fused):
    worker = StreamWorker()
    device = Device(worker, fused)
    rng = np.random.default_rng(6)
    small = inputs(rng, 2)
    site = device.submit(0, 0, *small)
    assert device.sync(site, 2)[0] == 0
    before = worker.staging(site, 2, HIDDEN, TOP_K, np.float32, np.float32)[0].ctypes.data
    big = inputs(rng, 200)
    assert device.sync(device.submit(0, 0, *big), 200)[0] == 0  # the slot's staging replaced by a larger one
    assert worker.staging(site, 2, HIDDEN, TOP_K, np.float32, np.float32)[0].ctypes.data == before
    status, y = device.sync(device.submit(0, 0, *small), 2)  # the first site, at its own (kept) buffers
    assert status == 0
    np.testing.assert_array_equal(y, fused.forward(0, *small))


BF16_KERNEL, BF16_WHY = best_kernel(BF16)


@pytest.mark.skipif(BF16_KERNEL not in BACKWARD_KERNELS, reason=f"no fused backward kernel here: {BF16_WHY}")
def test_a_training_forward_and_its_backward_equal_the_direct_calls():
    store = make_store(experts=EXPERTS, hidden=HIDDEN, dtype=BF16)
    engine = HostMoE(store, threads=2)
    fused = engine.fused_forward()
    assert fused is not None and fused.has_backward
    fused.prepare([1])
    fused.prepare([1], backward=True)
    worker = StreamWorker()
    rng = np.random.default_rng(7)
    tokens = 6
    x = rng.standard_normal((tokens, HIDDEN)).astype(BF16)
    ids, weights = routing(rng, tokens, EXPERTS, TOP_K)
    dy = rng.standard_normal((tokens, HIDDEN)).astype(np.float32)

    def device():
        keep = worker.site(fused.call_address(1), 1, 0, tokens, HIDDEN, TOP_K, BF16, np.float32, FORWARD_KEEPING)
        x_in, ids_in_keep, w_in, y_out = worker.staging(keep, tokens, HIDDEN, TOP_K, BF16, np.float32)
        x_in[...], ids_in_keep[...], w_in[...] = x, ids, weights
        worker.post(keep)
        assert worker.wait(keep, 30) == 0
        y = y_out.copy()
        back = worker.site(
            fused.backward_call_address(1), 1, 1, tokens, HIDDEN, TOP_K, np.float32, np.float32, BACKWARD
        )
        dy_in, ids_in, w_in, dx_out, ticket_in, dw_out = worker.staging(
            back, tokens, HIDDEN, TOP_K, np.float32, np.float32
        )
        dy_in[...], ids_in[...], w_in[...], ticket_in[...] = dy, ids, weights, worker.answer(keep)
        worker.post(back)
        assert worker.wait(back, 30) == 0
        answered = dx_out.copy(), dw_out.copy()
        ticket_in[...] = keep  # the site without its call: the first call's ticket, not the one answered
        worker.post(back)
        assert worker.wait(back, 30) == FAILED
        assert "overwritten" in worker.take_error().message
        ids_in_keep[0, 0] = EXPERTS + 1  # a keeping forward that fails answers no ticket a backward could take
        worker.post(keep)
        assert worker.wait(keep, 30) == FAILED and worker.answer(keep) == -1
        assert worker.take_error().layer == 1
        return y, *answered

    y, dx, dweights = on_device_thread(device)
    want_y, kept = fused.forward(1, x, ids, weights, keep=True)
    want_dx, want_dweights = fused.backward(1, x, ids, weights, dy, kept)
    np.testing.assert_array_equal(y, want_y)
    np.testing.assert_array_equal(dx, want_dx)
    np.testing.assert_array_equal(dweights, want_dweights)


def test_cuda_side_says_why_it_cannot_run_here():
    usable, reason = cuda_status()
    if usable:
        pytest.skip("a CUDA driver is present: the device run (bench/accelerator.sh) tests this side")
    assert reason  # a reason, not a crash: the driver is opened only when asked for
    with pytest.raises(Exception, match="CUDA"):
        StreamWorker(memory="cuda")


def test_cuda_handlers_are_built_into_the_library():
    # the install finds cuda.h (the nvidia-cuda-runtime build requirement) and builds the CUDA handlers in
    assert native.cuda_function("moe_cuda_stream_status") is not None
    for symbol in ("moe_jax_cuda_stream_submit", "moe_jax_cuda_stream_sync"):
        assert hasattr(native.lib(), symbol)


def cuda_include() -> Path:
    spec = importlib.util.find_spec("nvidia")
    for location in spec.submodule_search_locations if spec else []:
        for include in sorted(Path(location).glob("cu*/include"), reverse=True):
            if (include / "cuda.h").exists():
                return include
    pytest.fail("the nvidia-cuda-runtime wheel's cuda.h is missing (the test extra installs it)")


@pytest.mark.parametrize("source", CUDA_SOURCES)
def test_cuda_handlers_compile_against_the_pip_headers(source, tmp_path):
    # a build test: warnings are errors, so a handler that stops compiling (or starts warning) fails here
    jaxlib_include = Path(importlib.util.find_spec("jaxlib").origin).parent / "include"
    compiler = sysconfig.get_config_var("CC").split()[0] or "cc"
    command = [compiler, "-O2", "-Wall", "-Wextra", "-Werror", "-c", str(CSRC / source), "-o", str(tmp_path / "h.o")]
    command += ["-I", str(jaxlib_include), "-I", str(cuda_include())]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
