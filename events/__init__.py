"""The log's vocabulary: every event Shoal records (``catalogue``), the records they carry, the
states and kinds they name, the subjects they are published on, and the other messages that
cross processes (``tokenizer``, ``attempts``). Pure pydantic: it imports nothing from ``bus/``
(the NATS transport) nor from any package above it, and every one of them imports it."""
