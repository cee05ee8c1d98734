"""`HostOptions` (``Scheduler(host=...)``): the host tiers' options check themselves, and each
refusal says what was wrong and what to give."""

from __future__ import annotations

from pathlib import Path

import pytest

from residency import ConfigError, Scheduler
from residency.options.host_options import HostOptions, as_host_options

pytestmark = pytest.mark.fast  # every test here is in the fast tier (tests/README.md)


def test_the_default_is_every_master_in_memory_without_a_cache():
    options = as_host_options(None)
    assert options == HostOptions()
    assert options.cache_directory is None and options.memory_limit is None
    assert options.background_reads is False


def test_paths_and_sizes_are_normalised(tmp_path):
    options = HostOptions.from_dict({"cache_directory": str(tmp_path), "memory_limit": "2GiB",
                                     "spill_directory": "~/spill"})
    assert options.cache_directory == tmp_path
    assert options.memory_limit == 2 * 2**30
    assert options.spill_directory == Path.home() / "spill"
    assert HostOptions.from_dict(options) is options


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"memory_limt": 1}, "host has unknown keys ['memory_limt']; the keys are "
                             "cache_directory, memory_limit, spill_directory, background_reads. "
                             "Did you mean 'memory_limit'?"),
        ({"memory_limit": "lots"}, "memory_limit='lots'; give bytes: a whole number >= 0, or a "
                                   "size such as '38GiB'"),
        ({"memory_limit": -1}, "memory_limit=-1; give bytes: a whole number >= 0"),
        ({"memory_limit": "3.7B"}, "memory_limit='3.7B'; give bytes: a whole number >= 0"),
        ({"cache_directory": 3}, "cache_directory=3; give a directory path (a str or "
                                 "os.PathLike), or None"),
        ({"spill_directory": ""}, "spill_directory=''; give a directory path"),
        ("16GiB", "host='16GiB'; give HostOptions or an object with any of the keys "
                  "cache_directory, memory_limit, spill_directory, background_reads"),
        ({"background_reads": "yes"}, "background_reads='yes'; give True or False"),
        ({"background_reads": 1}, "background_reads=1; give True or False"),
    ],
)
def test_bad_options_are_refused_with_what_to_give(given, message):
    with pytest.raises(ConfigError) as raised:
        as_host_options(given)
    assert message in str(raised.value)


def test_the_scheduler_keeps_its_options_and_refuses_bad_ones(tmp_path):
    scheduler = Scheduler("cpu", host={"cache_directory": tmp_path})
    assert scheduler.host_options == HostOptions(cache_directory=tmp_path)
    scheduler.close()
    with pytest.raises(ConfigError, match="memory_limit='x'"):
        Scheduler("cpu", host={"memory_limit": "x"})


def test_a_memory_limit_with_a_process_group_is_refused_before_any_collective():
    """Ranks of a host share their masters, and a shared master is not file-backed: the limit
    could not hold.  Refused first (the group given here would fail any collective)."""
    with pytest.raises(ConfigError) as raised:
        Scheduler("cpu", process_group=object(), host={"memory_limit": "1GiB"})
    assert str(raised.value) == (
        "host memory_limit=1073741824 with a process_group: the ranks of a host share their host "
        "masters, and shared masters are not file-backed yet, so the limit could not hold. Leave "
        "memory_limit out with a process group (the masters are then the weights once per host), "
        "or run one process per host")
