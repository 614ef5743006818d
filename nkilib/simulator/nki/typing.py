"""`nki.typing` annotations (`nt.tensor[...]`, `nt.mutable_tensor`): no runtime effect."""


class _Annotation:
    def __class_getitem__(cls, item):
        return cls


class tensor(_Annotation):
    pass


class mutable_tensor(_Annotation):
    pass
