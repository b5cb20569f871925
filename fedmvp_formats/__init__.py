"""fedmvp_formats: the file formats and small protocols that fedmvp, export and edge_client share.

Why a leaf: the three packages import one way (fedmvp and edge_client import neither each other nor
export; export imports both, fedmvp to rebuild the model and edge_client for the bundle format it
writes; docs/architecture.md, Layers), so a format that fedmvp and edge_client both read had no
common home but this one, or a copy per package kept equal by tests. Here it is written once. This package imports only numpy, safetensors and the
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
- ``class_set``: the class-set digest, the one identity of a run's classes and their phrases.
- ``image_folder``, ``folder_walk``: a folder of labelled images, walked by the one rule, for a site and a device.
- ``messages``, ``packed``: the Flower message schema, and a model state as one flat array in a message.
- ``nofollow``, ``holder_lock``: writing inside a run or bundle without following a link; the one lock file.
- ``tensors``: the one check of tensors that arrive from elsewhere.
- ``parity_rules``: when a model's logits count as the reference's (the exporter and the device).
- ``privacy``: the differential-privacy settings and the sender's clip and noise.
"""
