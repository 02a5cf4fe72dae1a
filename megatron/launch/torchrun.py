"""torchrun as the run scripts start it:  ``python -m megatron.launch.torchrun [torchrun's flags]``

torchrun's own elastic agent, with the changes a user who launches by hand needs
(docs/fault_tolerance.md, "Stopping a run"):

- **Stop.** The first Ctrl-C (SIGINT) or SIGTERM the agent receives is passed to its workers
  and the agent goes on watching them: with ``--exit-signal-handler`` they save at the next
  step boundary and exit 0, and so does the agent. (torchrun's agent sends the workers
  SIGTERM, kills them 30 s later, and exits 1 with a ``SignalException`` traceback.) Workers
  that end after the signal are not restarted. A second signal is torchrun's: it shuts the
  workers down with that signal, and a second SIGINT ends a worker at once.
- **Rendezvous.** Each node of a multi-node run prints whom it waits for (``> waiting for
  2 nodes at host:port``) and, once they joined, how many did; a start with fewer than
  ``--nnodes MIN:MAX``'s MAX says so. One node prints its ranks.
- **No restart on a user error.** A worker that exits 2 (a setting or input error its own
  line names, found after start-up: a corrupt index, a checkpoint of another model) ends the
  run: ``--max-restarts`` would only print the same error again.
- **Failure.** One line per failed rank (exit code or signal; the rank's own lines above say
  why) instead of ``ChildFailedError``'s traceback; exit status 2 when a rank stopped on a
  user error (status 2) and the others only because of it (a peer lost: 3; ended by the
  agent: SIGTERM / SIGKILL), the stop signal's 128 + n after a stop whose workers did not
  save, else 1.

The hooks reach private names of ``torch.distributed.elastic`` (the module function torchrun
installs as its signal handler; the agent's ``_invoke_run``, ``_rendezvous``,
``_monitor_workers``, ``_remaining_restarts`` and ``_pcontext``); tests/test_launch_stop.py
runs them against the installed torch.
"""
import gc
import os
import signal
import socket
import sys

from torch.distributed import run as torchrun
from torch.distributed.elastic.agent.server import api as agent_api
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import api as mp_api
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from ..common.errors import PEER_LOST_EXIT, USER_ERROR_EXIT

#: Signals whose first arrival stops the run cleanly (the workers save and exit 0).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Launch:
    """What this agent knows of the launch (set by :func:`main`)."""

    min_nodes = max_nodes = 1
    endpoint = ""
    agents = []  # the elastic agents running (one)
    stop_signal = None  # the first stop signal received, once passed on


def _say(text):
    print(f"> {text}", flush=True)


def _worker_pids():
    pids = []
    for agent in _Launch.agents:
        pcontext = getattr(agent, "_pcontext", None)
        if pcontext is not None:
            pids += [pid for pid in pcontext.pids().values() if pid]
    return pids


def _on_signal(signum, frame):
    """The agent's handler (replaces torchrun's, which raises at once)."""
    pids = _worker_pids()
    if _Launch.stop_signal is None and signum in STOP_SIGNALS and pids:
        _Launch.stop_signal = signum
        for agent in _Launch.agents:
            agent._remaining_restarts = 0  # a run being stopped is not restarted
        name = signal.Signals(signum).name
        _say(f"{name} received: the workers save at the next step boundary and stop "
             f"(Ctrl-C again aborts at once)")
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        return
    # torchrun's own handling: the agent shuts its workers down with this signal. Its
    # agent (agent/server/api.py: "Received 2 death signal, shutting down workers") and its
    # process context (multiprocessing/api.py: "Sending process N closing signal", one per
    # worker) then log a warning each, which say again what main()'s one line says.
    _quiet_shutdown_warnings()
    raise SignalException(f"Process {os.getpid()} got signal: {signum}",
                          sigval=signal.Signals(signum))


def _quiet_shutdown_warnings():
    """Raise torch elastic's agent and process-context loggers to ERROR (the abort is ours
    to say, once)."""
    import logging

    for module in (agent_api, mp_api):
        logging.getLogger(module.logger.name).setLevel(logging.ERROR)


def _invoke_run(original):
    def invoke_run(self, *args, **kwargs):
        _Launch.agents.append(self)
        return original(self, *args, **kwargs)
    return invoke_run


def _rendezvous(original):
    def rendezvous(self, worker_group):
        spec = worker_group.spec
        restart = spec.max_restarts - self._remaining_restarts
        nodes = (f"{_Launch.max_nodes}" if _Launch.min_nodes == _Launch.max_nodes
                 else f"{_Launch.min_nodes} to {_Launch.max_nodes}")
        again = f"restart {restart} of {spec.max_restarts}: " if restart else ""
        if _Launch.max_nodes > 1 or restart:  # one node waits for nobody
            _say(f"{again}{socket.gethostname()} waiting for {nodes} node"
                 f"{'s' if nodes != '1' else ''} at {_Launch.endpoint} "
                 f"({spec.local_world_size} processes each)")
        original(self, worker_group)
        joined, ranks = worker_group.group_world_size, [w.global_rank for w in
                                                        worker_group.workers]
        world = worker_group.workers[0].world_size if worker_group.workers else 0
        line = (f"{joined} of {_Launch.max_nodes} nodes joined; this is node "
                f"{worker_group.group_rank}: ranks {min(ranks)}-{max(ranks)} of {world}"
                if _Launch.max_nodes > 1 else f"ranks 0-{world - 1} on this node")
        if joined < _Launch.max_nodes:
            line += (f" -- fewer nodes than asked (MIN_NODES {_Launch.min_nodes}): a smaller "
                     f"data-parallel size, the same global batch")
        _say(line)
    return rendezvous


def _monitor_workers(original):
    def monitor_workers(self, worker_group):
        result = original(self, worker_group)
        codes = [f.exitcode for f in (result.failures or {}).values()]
        if USER_ERROR_EXIT in codes and self._remaining_restarts:
            _say("a worker stopped on a setting or input error (exit 2, above): the run is "
                 "not restarted")
            self._remaining_restarts = 0  # the same error would come back every time
        return result
    return monitor_workers


def install_hooks():
    """Put the hooks in place (idempotent); torchrun then runs as usual."""
    if getattr(agent_api.SimpleElasticAgent, "_megatron_hooks", False):
        return
    mp_api._terminate_process_handler = _on_signal
    cls = agent_api.SimpleElasticAgent
    cls._invoke_run = _invoke_run(cls._invoke_run)
    cls._rendezvous = _rendezvous(cls._rendezvous)
    local = LocalElasticAgent
    local._monitor_workers = _monitor_workers(local._monitor_workers)
    cls._megatron_hooks = True


def failure_status(failures, stop_signal=None):
    """``(exit status, lines)`` for a failed run.

    Args:
        failures: ``{global rank: exit code}`` (a negative code: killed by that signal).
        stop_signal: the stop signal the agent passed on, or None.
    """
    lines = []
    for rank, code in sorted(failures.items()):
        how = (f"killed by {signal.Signals(-code).name}" if code < 0 and -code in
               signal.valid_signals() else f"exit code {code}")
        lines.append(f"rank {rank} failed ({how})")
    if stop_signal is not None:
        return 128 + int(stop_signal), lines
    # ranks ended because another failed: a peer lost (3), or stopped by the agent
    ended = {PEER_LOST_EXIT, -int(signal.SIGTERM), -int(signal.SIGKILL)}
    codes = set(failures.values())
    if USER_ERROR_EXIT in codes and codes <= ended | {USER_ERROR_EXIT}:
        return USER_ERROR_EXIT, lines
    return 1, lines


def main(argv=None):
    """Parse torchrun's flags, run its agent with the hooks; return the exit status."""
    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    _Launch.min_nodes, _Launch.max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
    _Launch.endpoint = args.rdzv_endpoint or f"{args.master_addr}:{args.master_port}"
    install_hooks()
    try:
        torchrun.run(args)
    except ChildFailedError as exc:
        status, lines = failure_status({rank: f.exitcode for rank, f in exc.failures.items()},
                                       _Launch.stop_signal)
        for line in lines:
            _say(line)
        _say("the run failed: each rank's own lines above say why" if status != 2 else
             "the run stopped on a setting or input error (above)")
        return status
    except SignalException as exc:
        _say(f"aborted by {exc.sigval.name}: the workers were ended where they were")
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:
        _say("interrupted (Ctrl-C) before the workers started")
        return 128 + int(signal.SIGINT)
    if _Launch.stop_signal is not None:
        _say(f"stopped on {signal.Signals(_Launch.stop_signal).name}; every worker exited 0")
    return 0


if __name__ == "__main__":
    status = main()
    gc.freeze()  # the interpreter's final collections would only delay the exit (errors.py)
    sys.exit(status)
