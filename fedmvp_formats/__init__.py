"""fedmvp_formats: the file formats and small protocols that fedmvp, export and edge_client share.

Why a leaf: the three packages import one way (export and edge_client never import fedmvp back,
fedmvp imports neither), so a format they all read had to be written once per package and kept
equal by tests. Here it is written once. This package imports only numpy, safetensors and the
standard library, and none of the project's packages: every one of them may import it, and the
smallest install (edge inference, no torch) carries it.

- ``atomic``: atomic writes (temp file, fsync, rename) of files and folders.
- ``flower_env``: the environment every Flower process of ours runs under (quiet, offline).
- ``files``: ``sha256_file``, the writable probe, an OSError as one line.
- ``lazy``: a package's public API imported on first use (each ``__init__``'s ``__getattr__``).
- ``method``: the method record (fields, ranges, help; its version and the migration of older records).
- ``bundle_manifest``: the bundle manifest's schema, its file names and the refresh's names.
- ``names``: tensor name prefixes (``promptformer.``, ``lora.``).
- ``objective``: the FedMVP loss, CE + alpha * L_con, for the server's model and the device's program.
- ``promptformer``: the PromptFormer digest a bundle and a run agree on.
- ``shown``: untrusted text as an error message may show it (escaped, cut short).
- ``update``: the update file a device trains and a server ingests: one reader, one writer.
"""
