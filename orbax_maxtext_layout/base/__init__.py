"""The ground floor: names, tree paths, boxes and the garbage collector's freeze.

Owns what every room shares and nothing that reads or writes: the entry names of a step
directory in both layouts (`names`), flat views of nested trees (`treepaths`), boxes of
arrays and the flat runs they cover (`boxes`), and `gcfreeze.frozen_heap` for operations
over many leaves (`gcfreeze.freeze_for_exit` for the CLI's and the runner's exits).

Imports: nothing of the package but `errors`. Everything may import it.
"""
