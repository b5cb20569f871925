"""Protocol presets: the shipped TOML files in this folder, and their schema and parser
(``fedmvp.presets.schema``)."""
