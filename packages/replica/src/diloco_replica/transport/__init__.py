"""What crosses the wire: codecs, the tensor wire format, finiteness checks, where codec arithmetic
runs, and fault injection into what is sent."""
