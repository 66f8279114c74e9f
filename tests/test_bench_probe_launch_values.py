"""bench/probe_launch_values.py refuses a field or value before any GPU work, and builds one config per value."""

import pytest

from bench.probe_launch_values import base_config, launch_configs, value_list
from nsa_model.ops import triton_impl


def test_one_config_per_value_differing_only_in_the_field():
    base = triton_impl.LaunchConfig()
    configs = launch_configs(base, "range_dkdv_q_chunk", [0, 2048])
    assert [c.range_dkdv_q_chunk for c in configs.values()] == [0, 2048]
    assert configs[2048].slc_block_chunk == base.slc_block_chunk


def test_a_bool_field_takes_0_and_1():
    configs = launch_configs(triton_impl.LaunchConfig(), "side_stream", [1, 0])
    assert [c.side_stream for c in configs.values()] == [True, False]


@pytest.mark.parametrize("field, values, message", [("slc_kernel", [0], "not an integer or bool LaunchConfig field"),
                                                    ("side_stream", [0, 2], "a bool: 0 or 1"),
                                                    ("range_dkdv_q_chunk", [0, -1], "must be an int >= 0")])
def test_a_field_or_value_launch_config_refuses_stops_the_probe(field, values, message):
    with pytest.raises(SystemExit, match=message):
        launch_configs(triton_impl.LaunchConfig(), field, values)


def test_values_are_distinct_integers():
    assert value_list("0,2048") == [0, 2048]
    for bad in ("0,x", "0,0"):
        with pytest.raises(Exception):
            value_list(bad)


def test_settings_change_the_base_of_every_value():
    base = base_config(triton_impl.LaunchConfig(), ["slc_auto_tiled_blocks=64", "side_stream=false",
                                                    "slc_kernel=tiled"])
    assert (base.slc_auto_tiled_blocks, base.side_stream, base.slc_kernel) == (64, False, "tiled")
    configs = launch_configs(base, "slc_tile_rows", [64, 32])
    assert [(c.slc_tile_rows, c.slc_auto_tiled_blocks) for c in configs.values()] == [(64, 64), (32, 64)]


@pytest.mark.parametrize("setting, message", [("nope=1", "a LaunchConfig field"), ("side_stream=1", "a bool"),
                                              ("slc_tile_rows=x", "is an int"), ("slc_kernel=fast", "must be one of")])
def test_a_bad_setting_stops_the_probe(setting, message):
    with pytest.raises(SystemExit, match=message):
        base_config(triton_impl.LaunchConfig(), [setting])
