"""torch's gloo exit race, made to happen every time (issue 32: "a clean end must stay clean").

A rank of a gloo job aborts at its interpreter's exit (``terminate called without an active
exception``, SIGABRT, exit 134) when one of ``ProcessGroupGloo``'s worker threads
(``pt_gloo_runloop``) drops the last reference to a finished collective while the main thread is
already finalizing the interpreter. Seen in a core of ``ddp_epochs.py``'s rank 1 under load::

    #10 std::terminate()
    #13 _Unwind_ForcedUnwind ()
    #16 __GI___pthread_exit ()
    #17 PyThread_exit_thread () at Python/thread_pthread.h:366
    #18 take_gil () at Python/ceval_gil.h:289
    #20 pybind11::gil_scoped_acquire::gil_scoped_acquire()
    #21 torch::detail::ConcretePyInterpreterVTable::decref(_object*) const
    #22 std::_Sp_counted_ptr_inplace<c10::SafePyObject, ...>::_M_dispose()
    #23 at::ThreadLocalState::~ThreadLocalState()
    #24 c10d::ProcessGroupGloo::AsyncWork::~AsyncWork()
    #25 c10d::AsyncAllreduceWork::~AsyncAllreduceWork()
    #26 c10d::ProcessGroupGloo::runLoop(int)

(the main thread meanwhile in ``Py_FinalizeEx`` → ``PyGC_Collect``). The work's destructor
releases Python objects (the ``contextvars.Context`` that autograd's ``_engine_run_backward``
stashes in the thread-local state every work made during a backward copies, and the tensors'
own PyObjects), so it takes the GIL (``ConcretePyInterpreterVTable::decref`` in
torch/csrc/PyInterpreter.cpp: it leaks the object once ``Py_IsInitialized()`` is false, else
``gil_scoped_acquire``); CPython (3.11 here) ends a thread that waits for the GIL when the
finalization begins with ``pthread_exit``, whose forced unwinding meets the destructor's
``noexcept`` and calls ``std::terminate``. Nothing of the launcher is involved: it happens
under ``torchrun`` as under ``pslaunch --tracker torch``. In a DDP program the window is the
time from the last backward's allreduce to the interpreter's finalization (short in a rank that
just leaves, under load as long as the gloo thread waits for a CPU).

This program holds that window open. Rank 1 starts an allreduce inside a backward (as DDP does)
and drops its handle: its gloo thread now holds the work's last reference, and waits for
rank 0. At rank 1's exit, its last ``atexit`` handlers write ``--flag`` (rank 0 joins the
allreduce then) and hold the GIL for ``--hold`` seconds in C, straight into the finalization, so
the gloo thread asks for the GIL before the finalization begins and gets it only after.

``--safe-exit``: rank 1 ends as torch's race allows, with ``os._exit(0)`` (output flushed) at
the end of its ``atexit`` handlers: the interpreter never finalizes, the job ends clean.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import os
import sys
import time


def _hold_then_leave(hold: float, flag: str, safe: bool) -> None:
    """Rank 1's last atexit handlers (registered first: ``atexit`` runs them last)."""
    if safe:
        atexit.register(_leave_now)
    # (a PyDLL call keeps the GIL: no bytecode runs between this and the finalization)
    atexit.register(ctypes.PyDLL(None).usleep, int(hold * 1e6))
    atexit.register(lambda: os.close(os.open(flag, os.O_CREAT | os.O_WRONLY, 0o644)))


def _leave_now() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flag", required=True, help="a file rank 1 creates at its exit")
    ap.add_argument("--hold", type=float, default=2.0, help="seconds rank 1 holds the GIL at its exit")
    ap.add_argument("--safe-exit", action="store_true")
    ap.add_argument("--work-after", type=float, default=1.0,
                    help="seconds rank 0 works on after the allreduce (rank 1 aborts meanwhile)")
    a = ap.parse_args()
    if os.environ.get("RANK") == "1":
        _hold_then_leave(a.hold, a.flag, a.safe_exit)

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(4)
    if rank == 0:
        deadline = time.monotonic() + 120
        while not os.path.exists(a.flag) and time.monotonic() < deadline:
            time.sleep(0.01)
        dist.all_reduce(t)
        print(f"rank 0: allreduce done ({t[0].item():g})", flush=True)
        time.sleep(a.work_after)  # (rank 1 ends meanwhile)
        print("rank 0: work after the allreduce done", flush=True)
    else:
        x = torch.ones(4, requires_grad=True)
        x.register_hook(lambda g: (dist.all_reduce(t, async_op=True), g)[1])  # a work made in a backward
        (x * 2).sum().backward()
        print("rank 1: leaving", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
