module pacegate.test/client

go 1.19
