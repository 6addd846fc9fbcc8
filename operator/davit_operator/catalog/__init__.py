"""The versioned catalog: engine releases, image repositories and tags per variant, runners,
accelerators and model shapes. The YAML files here are package data; `loader` validates them."""
