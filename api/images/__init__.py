"""Images in requests, in every dialect: what a client sent (``inputs.py``), what the bytes are
(``formats.py``), fetching a URL safely (``fetching.py``), which models take images
(``vision.py``), and a request's images read, checked and stored by digest (``loading.py``,
``bus/stores/images.py``)."""
