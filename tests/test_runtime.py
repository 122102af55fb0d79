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

    from memprune.raysession import _log_cluster_messages

    monkeypatch.setattr(ray_worker, "print_to_stdstream", ray_worker.print_to_stdstream)  # restored afterwards
    _log_cluster_messages()
    with caplog.at_level(logging.WARNING):
        ray_worker.print_to_stdstream({"lines": ["WARNING: 8 PYTHON worker processes"], "pid": "raylet"},
                                      ignore_prefix=False)
    assert [r.getMessage() for r in caplog.records if r.name == "memprune.ray_cluster"] == [
        "(raylet) WARNING: 8 PYTHON worker processes"]
    captured = capsys.readouterr()
    assert "PYTHON worker" not in captured.out + captured.err


def test_a_memprune_error_in_a_ray_task_reaches_user_error_as_itself(ray_local) -> None:
    """Ray's RayTaskError subclasses its cause's class (so it passes for the memprune error) but its text is
    Ray's header plus the worker's traceback: `user_error` hands back the plain error and its one-line message."""
    import ray

    from memprune.runtime import one_line, user_error
    from memprune.schema import SchemaError

    @ray.remote(num_cpus=0)
    def fail() -> None:
        raise SchemaError("bullets.parquet: column 'text' missing")

    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(fail.remote(), timeout=60)
    wrapped = info.value
    assert isinstance(wrapped, SchemaError) and "\n" in str(wrapped)  # the wrapper: a SchemaError, many lines
    got = user_error(wrapped)
    assert type(got) is SchemaError and str(got) == one_line(got) == "bullets.parquet: column 'text' missing"
    try:  # wrapped once more, as a Ray Data task or the driver's own handler does
        raise RuntimeError("the pipeline failed") from wrapped
    except RuntimeError as outer:
        again = user_error(outer)
    assert type(again) is SchemaError and str(again) == "bullets.parquet: column 'text' missing"
    assert user_error(RuntimeError("no memprune error here")) is None
