"""Search: the solver over layouts and the manual grid of hand-written layouts it is compared with."""
