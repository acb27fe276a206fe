"""RemovedPaths, as a plugin author's rescan uses it: which paths a batch's remove events took."""

from __future__ import annotations

from devplug import RemovedPaths, UdevEvent

GPU = "/sys/devices/pci0000:00/0000:00:02.0"
RENDER = f"{GPU}/drm/renderD128"
CARD = f"{GPU}/drm/card0"


def event(action: str, path: str) -> UdevEvent:
    return UdevEvent(action, path, "drm")


def test_a_removed_path_and_everything_below_it_are_gone() -> None:
    gone = RemovedPaths([event("remove", RENDER), event("remove", GPU)])
    assert gone.covers(GPU) and gone.covers(RENDER) and gone.covers(CARD)
    assert not gone.covers("/sys/devices/pci0000:00/0000:00:02.00")  # a name sharing a prefix
    assert not gone.covers("/sys/devices/pci0000:00")


def test_a_removal_of_one_minor_leaves_the_card_and_its_other_minor() -> None:
    gone = RemovedPaths([event("change", GPU), event("remove", RENDER)])
    assert gone.covers(RENDER)
    assert not gone.covers(GPU) and not gone.covers(CARD)
    assert not gone.covers_all([GPU, CARD, RENDER]) and gone.covers_all([RENDER])


def test_a_path_added_again_in_the_same_batch_is_not_gone() -> None:
    gone = RemovedPaths([event("remove", RENDER), event("add", RENDER)])
    assert not gone and not gone.covers(RENDER)
    assert RemovedPaths([event("add", RENDER), event("remove", RENDER)]).covers(RENDER)


def test_a_batch_without_removals_covers_nothing() -> None:
    gone = RemovedPaths([event("add", GPU), event("change", RENDER)])
    assert not gone and not gone.covers(RENDER) and not gone.covers_all([])
