"""``wbridge.integrations.sglang`` without SGLang: the options travel as JSON and are checked; the
engine arguments raise ``MissingExtraError`` where SGLang is not installed."""

from __future__ import annotations

import importlib.util
import json

import pytest

from wbridge import Zone
from wbridge.errors import MissingExtraError, UsageError
from wbridge.integrations.sglang import SGLangOptions, engine_args
from wbridge.integrations.sglang.options import EXTRA_KEY


def test_options_round_trip_through_the_loader_extra_config():
    opts = SGLangOptions(channel="policy", store="tcp://127.0.0.1:29700", token="t", dtype="bfloat16",
                         commit="swap", zone=Zone("a", relay=True), subscriber_options={"lease_ttl": 3.0})  # fmt: skip
    text = opts.to_extra_config({"enable_multithread_load": False})
    back, rest = SGLangOptions.from_extra_config(text)
    assert back == opts and rest == {"enable_multithread_load": False}
    assert json.loads(text)[EXTRA_KEY]["subscriber_options"] == {"lease_ttl": 3.0}
    assert back.zone == Zone("a", relay=True)


def test_a_zone_name_alone_is_a_zone_that_does_not_relay():
    opts = SGLangOptions(channel="policy", store="tcp://127.0.0.1:1", zone="far")
    assert opts.zone == Zone("far") and SGLangOptions.from_extra_config(opts.to_extra_config())[0] == opts


@pytest.mark.parametrize(
    "kw, word",
    [
        ({"channel": ""}, "channel"),
        ({"dtype": "int8"}, "dtype"),
        ({"commit": "move"}, "commit"),
        ({"pull_timeout": 0}, "pull_timeout"),
        ({"subscriber_options": {"bogus": 1}}, "subscriber_options"),
        ({"subscriber_options": {"zone": "a"}}, "subscriber_options"),
        ({"zone": 5}, "zone"),
        ({"zone": "a/b"}, "Zone"),
        ({"token": 5}, "token"),
    ],
)
def test_bad_options_raise_usage_errors_naming_them(kw, word):
    with pytest.raises(UsageError, match=word):
        SGLangOptions(**{"channel": "policy", "store": "tcp://127.0.0.1:1", **kw})


def test_loader_without_wbridge_options_says_how_to_build_them():
    with pytest.raises(UsageError, match="engine_args"):
        SGLangOptions.from_extra_config('{"enable_multithread_load": true}')


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_engine_args_without_sglang_raise_missing_extra():
    with pytest.raises(MissingExtraError, match="needs SGLang"):
        engine_args(SGLangOptions(channel="policy", store="tcp://127.0.0.1:1"))
