"""What a model's files are, read from the files alone: a GGUF header, which files of a
sharded model hold which layers. Below the engines and the services, which both read them."""
