"""A transport of a single rank, for a Pipeline whose steps all run in the test's process."""


class OneRank:
    rank, size = 0, 1

    def send(self, array, dst):
        raise AssertionError("a pipeline of one rank sends nothing")

    def close(self):
        pass
