"""Host unit tests of the device-map rule (ibckpt/devicemap.py): which new device each used one gets,
and the operator's check of a node's devices."""

from __future__ import annotations

import pytest

from ibckpt.devicemap import DeviceMapError, device_map, renames, unfit


def test_same_names_map_to_themselves_and_rename_nothing() -> None:
    mapping = device_map(["mlx5_0", "mlx5_1"], ["mlx5_0", "mlx5_1"], ["mlx5_1", "mlx5_0"])
    assert mapping == {"mlx5_0": "mlx5_0", "mlx5_1": "mlx5_1"}
    assert renames(mapping) == {}


def test_a_single_device_pod_keeps_its_device() -> None:
    assert renames(device_map(["rxe0"], ["rxe0"], ["rxe0"])) == {}


def test_renamed_devices_map_by_their_position_in_the_allocation() -> None:
    # the old pod was given mlx5_2 then mlx5_3, the new one mlx5_6 then mlx5_5: order is kept
    mapping = device_map(["mlx5_3", "mlx5_2"], ["mlx5_2", "mlx5_3"], ["mlx5_6", "mlx5_5"])
    assert mapping == {"mlx5_3": "mlx5_5", "mlx5_2": "mlx5_6"}


def test_a_same_name_wins_over_the_position() -> None:
    # mlx5_1 is still given (at position 0): it stays, although position 1 now holds mlx5_4
    assert device_map(["mlx5_1"], ["mlx5_0", "mlx5_1"], ["mlx5_1", "mlx5_4"]) == {"mlx5_1": "mlx5_1"}


def test_a_same_name_and_a_position_that_collide_are_refused() -> None:
    with pytest.raises(DeviceMapError, match="both become mlx5_1"):
        device_map(["mlx5_0", "mlx5_1"], ["mlx5_0", "mlx5_1"], ["mlx5_1", "mlx5_4"])


def test_the_explicit_map_wins() -> None:
    mapping = device_map(
        ["rxe0", "rxe1"], ["rxe0", "rxe1"], ["rxe0", "rxe1"], {"rxe0": "rxe1", "rxe1": "rxe0"}
    )
    assert renames(mapping) == {"rxe0": "rxe1", "rxe1": "rxe0"}


def test_an_explicit_target_the_container_was_not_given_is_refused() -> None:
    with pytest.raises(DeviceMapError, match="sends rxe0 to mlx5_9, which the container was not given"):
        device_map(["rxe0"], ["rxe0"], ["mlx5_0"], {"rxe0": "mlx5_9"})


def test_a_device_past_the_new_allocation_is_refused_naming_both_sides() -> None:
    with pytest.raises(DeviceMapError) as refused:
        device_map(["mlx5_0", "mlx5_1"], ["mlx5_0", "mlx5_1"], ["mlx5_7"])
    assert "device mlx5_1 (position 1 of mlx5_0, mlx5_1)" in str(refused.value)
    assert "the container was given mlx5_7" in str(refused.value)


def test_a_device_outside_the_recorded_allocation_needs_its_name() -> None:
    with pytest.raises(DeviceMapError, match="device rxe0 \\(no recorded allocation\\)"):
        device_map(["rxe0"], [], ["rxe1"])
    assert device_map(["rxe0"], [], ["rxe1", "rxe0"]) == {"rxe0": "rxe0"}


def test_a_device_used_twice_is_mapped_once() -> None:
    assert device_map(["a", "b", "a"], ["a", "b"], ["c", "d"]) == {"a": "c", "b": "d"}


def test_the_operator_check_counts_distinct_devices() -> None:
    assert unfit(["mlx5_0", "mlx5_0"], ["rxe0"]) == ""
    why = unfit(["mlx5_0", "mlx5_1"], ["rxe0"])
    assert why == "its ranks used 2 RDMA devices (mlx5_0, mlx5_1), the node has 1 (rxe0)"
    assert "the node has 0 (none)" in unfit(["rxe0"], [])


def test_the_operator_check_wants_the_explicit_targets_on_the_node() -> None:
    assert unfit(["rxe0"], ["rxe0", "rxe1"], {"rxe0": "rxe1"}) == ""
    assert (
        unfit(["rxe0"], ["rxe0"], {"rxe0": "mlx5_0"})
        == "the deviceMap names mlx5_0, not among the node's rxe0"
    )
    assert unfit(["rxe0"], ["rxe0"], {"other": "mlx5_0"}) == ""  # a pair for a device nobody used
