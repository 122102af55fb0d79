"""The replica's encoder queue (issue 27), without Ray: requests that queue while the encoder is busy share its
next call, in length order, and each gets its own rows back; a failing call fails only its requests."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from memprune.serve.app import EncoderQueue


def _until(cond, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _rows(texts: list[str]) -> np.ndarray:
    return np.array([[len(t), ord(t[0])] for t in texts], dtype=np.float32)


def test_requests_queued_while_encoding_share_one_length_sorted_call_and_get_their_own_rows() -> None:
    gate, calls = threading.Event(), []

    def embed(texts: list[str]) -> np.ndarray:
        calls.append(list(texts))
        if len(calls) == 1:
            assert gate.wait(10)
        return _rows(texts)

    encoder = EncoderQueue(embed, max_requests=3, wait_s=0.0)
    sessions = [[c * k for k in (3, 1, 2)] for c in "bcde"]
    with ThreadPoolExecutor(5) as pool:
        first = pool.submit(encoder, ["a"])
        _until(lambda: len(calls) == 1)  # the encoder is busy with the first request
        rest = [pool.submit(encoder, s) for s in sessions]
        _until(lambda: encoder._queue.qsize() == 4)
        gate.set()
        got = [f.result(10) for f in rest]
    np.testing.assert_array_equal(first.result(), _rows(["a"]))
    for texts, rows in zip(sessions, got):
        np.testing.assert_array_equal(rows, _rows(texts))
    assert [len(c) for c in calls] == [1, 9, 3]  # at most 3 requests a call: the fourth waits for the next
    assert all(c == sorted(c, key=len) for c in calls)
    assert encoder.stats["batches"] == 3 and encoder.stats["requests"] == 5 and encoder.stats["texts"] == 13


def test_a_failing_call_fails_its_requests_and_the_encoder_goes_on() -> None:
    def embed(texts: list[str]) -> np.ndarray:
        if "boom" in texts:
            raise ValueError("the encoder failed")
        return _rows(texts)

    encoder = EncoderQueue(embed, max_requests=8, wait_s=0.001)
    with pytest.raises(ValueError, match="the encoder failed"):
        encoder(["boom", "x"])
    np.testing.assert_array_equal(encoder(["ok", "fine"]), _rows(["ok", "fine"]))


def test_a_bad_request_in_a_shared_call_fails_alone_and_the_others_get_their_rows() -> None:
    """Issue 56, item 5: a text the encoder cannot take fails its own request; the requests that shared its call are
    encoded again each alone and answered."""
    gate, calls = threading.Event(), []

    def embed(texts: list[str]) -> np.ndarray:
        calls.append(list(texts))
        if len(calls) == 1:
            assert gate.wait(10)
        if "boom" in texts:
            raise ValueError("cannot encode 'boom'")
        return _rows(texts)

    encoder = EncoderQueue(embed, max_requests=8, wait_s=0.0)
    sessions = [["good", "x"], ["fine"], ["boom", "y"], ["also", "zz"]]
    with ThreadPoolExecutor(5) as pool:
        first = pool.submit(encoder, ["a"])
        _until(lambda: len(calls) == 1)
        rest = [pool.submit(encoder, s) for s in sessions]
        _until(lambda: encoder._queue.qsize() == 4)
        gate.set()
        first.result(10)
        for texts, future in zip(sessions, rest):
            if "boom" in texts:
                with pytest.raises(ValueError, match="cannot encode 'boom'"):
                    future.result(10)
            else:
                np.testing.assert_array_equal(future.result(10), _rows(texts))
    assert len(calls) == 1 + 1 + 4  # the shared call failed, then each of its four requests alone
