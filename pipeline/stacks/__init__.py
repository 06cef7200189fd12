"""The stack stage: raw stacks (schemas.raw) in, combined-order frames out.

Between reading a run (`pipeline.rawrun`) and loading it (`pipeline.db`), and for in-process use:

- `order`     the combined order of one stack, the definition: each native eval-loop frame stands
              for the Python frames it ran, up to and including the next entry frame.
- `flatten`   a run's stacks hashed and modules keyed (the rules of `schemas.identity`, which the
              capture shares); the frames of chosen stacks as flat numpy columns.
- `layout`    the combined order and inline expansion over whole runs at once (numpy), shaped like
              the database's `stack_frames`: the ingest's path, held to `order` by the tests.
- `render`    frames as dicts for people (`format_frames`: `file:line:function`, innermost first),
              and raw tables symbolized through `order` (small batches).
- `live`      `symbolize(tracebacks)`: tracebacks gathered in this process, symbolized in place.
"""
