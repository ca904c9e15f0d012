"""Where bytes live: local disks and ``gs://`` object stores, locks, the page cache, data
file placement (reflink, hard link, copy), per-thread scratch buffers and fresh memory
(freed heap memory given back: `scratch.trim`), what an operation may hold and how many
threads run it (`memory`: the one default budget, the worker policies, the one gate on
bytes in flight), the compiled transposing copy (the
package's one C module), and the one rule for paths a checkpoint names itself, with the
walk that opens a file beneath a directory one component at a time (`containment`).
Local files are read, never mapped (a mapped page of a file cut short meanwhile is a
SIGBUS: docs/reliability.md).

`store.store_for(root)` decides once how a root is handled (a disk or an object store);
every room above hands the store it got down instead of deciding again. Nothing here
knows what an Orbax item or a model is.

Imports: `base`, `errors`. Offers: `store` (`store_for`, `StepStore`), `objstore`,
`lock` (`step_lock`), `placement` (`Placer`), `pagecache`, `scratch`, `memory`
(`DEFAULT_BUDGET`, `Workers`, `Gate`), `transpose`
(`transpose_into`), `containment`.
"""
