"""The Ray session memprune starts: its state API is its own, and the cluster's messages go to the log."""

from __future__ import annotations

import logging

import pytest


def test_the_state_api_of_a_local_instance_is_its_own(ray_local) -> None:
    """Ray Train's placement-group cleaner asks the state API whether its controller lives: in a local instance
    the workers reach this instance's API server, whatever /tmp/ray/ray_current_cluster names."""
    import ray

    @ray.remote(num_cpus=0)
    class Probe:
        def state_of(self, actor_id: str) -> str:
            from ray.util.state import get_actor

            state = get_actor(actor_id, timeout=10)
            return state.state if state is not None else "unknown"

    probe = Probe.remote()
    assert ray.get(probe.state_of.remote(probe._actor_id.hex()), timeout=60) == "ALIVE"
    ray.kill(probe)


def test_cluster_messages_go_to_the_log_not_the_terminal(monkeypatch: pytest.MonkeyPatch, caplog, capsys) -> None:
    """Ray's driver prints the raylet's warnings ("N worker processes have been started") from a listener
    thread; quiet mode sends them to the logging system, outside the "ray" logger (it prints to stderr)."""
    import ray._private.worker as ray_worker

    from memprune.runtime import _log_cluster_messages

    monkeypatch.setattr(ray_worker, "print_to_stdstream", ray_worker.print_to_stdstream)  # restored afterwards
    _log_cluster_messages()
    with caplog.at_level(logging.WARNING):
        ray_worker.print_to_stdstream({"lines": ["WARNING: 8 PYTHON worker processes"], "pid": "raylet"},
                                      ignore_prefix=False)
    assert [r.getMessage() for r in caplog.records if r.name == "memprune.ray_cluster"] == [
        "(raylet) WARNING: 8 PYTHON worker processes"]
    captured = capsys.readouterr()
    assert "PYTHON worker" not in captured.out + captured.err
