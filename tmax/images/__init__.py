"""Task images: one content-addressed SIF per task in a store on shared scratch."""

from __future__ import annotations

from pathlib import Path


def open_builds(store: str | Path, *, builder: str = "auto", mirror: str | None = None,
                check: bool = True, cache_dir: str | Path | None = None,
                base_map: str | Path | None = None):
    """An ``ImageBuilds`` over ``store`` with the named builder (and build-time checks);
    ``base_map`` (else $TMAX_BASE_MAP) is a user's map of images to bases, tried first.
    Builds and runs must see the same map: it decides the bases, hence the digests."""
    from tmax.images.bases import default_base_map
    from tmax.images.build import ImageBuilds
    from tmax.images.builders import ApptainerBuilder, Builder, LocalBuilder, default_builder
    from tmax.images.store import ImageStore, default_cache

    cache = Path(cache_dir or default_cache())
    chosen: Builder = {"auto": lambda: default_builder(cache, mirror),
              "apptainer": lambda: ApptainerBuilder(mirror=mirror),
              "local": lambda: LocalBuilder(cache, mirror)}[builder]()
    checker = None
    if check:
        from tmax.images.checks import image_checker

        checker = image_checker(cache)
    return ImageBuilds(ImageStore(store), chosen, checker=checker,
                       base_map=default_base_map(base_map))
