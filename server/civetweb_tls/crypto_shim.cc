// The soname "libcrypto.so" for civetweb's dlopen("libcrypto.so") (see ssl_shim.cc): no code of its own,
// every symbol comes from its dependency on OpenSSL 3's libcrypto. It also makes the HTTP server's TLS work
// where the unversioned development links (libssl-dev) are not installed, as in the runtime image.
extern "C" __attribute__((visibility("default"))) int qkvserve_civetweb_crypto_shim() { return 3; }
