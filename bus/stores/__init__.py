"""The claim-check stores: what is too big to ride in an event (a prompt's parts, an image, a
model's files) is stored once by digest on JetStream, and the event names it."""
