POLICIES = {"lru": None}
