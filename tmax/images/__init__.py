"""Task images: one content-addressed SIF per task in a store on shared scratch.

``tmax.images.build.open_builds`` is the entry point; docs/layout.md lists the modules (what
is pure planning, what executes a plan)."""
