"""The model fetcher: the program a fetch Job runs (`davit fetch`), not part of the operator
process.

It copies the files an engine needs from one model source at one revision into the model
cache volume, resumably and verified, and reports what it did as a `FetchResult` (its
termination message), serving its progress over HTTP while it runs. `result` is the document
the operator reads back; `select` decides which files are needed; `store` owns the cache
layout, partial files and verification; `hub` and `s3` talk to the sources; `main` is the
command line.
"""
