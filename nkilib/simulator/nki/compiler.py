"""`nki.compiler`: compiler directives have no effect in the simulator."""


def skip_middle_end_transformations(fn):
    return fn
