"""The ground floor: names, tree paths, boxes, a pool's results and the collector's freeze.

Owns what every room shares and nothing that reads or writes: the entry names of a step
directory in both layouts (`step_entries`), flat views of nested trees (`treepaths`), boxes of
arrays and the flat runs they cover (`array_boxes`), a pool's results with its first error raised
and no worker's frame behind it (`futures.results`), the one base of the reports operations
return (`reports.Report`: ``to_dict``, ``to_json``), and `gcfreeze` (`frozen_heap`,
`freeze_for_exit`), which only the command line and the runner use, for their own
processes: a library call never freezes the heap (issue 57).

Imports: nothing of the package but `errors`. Everything may import it.
"""
