// Debian bookworm's civetweb 1.15 is built for the OpenSSL 1.1 API and loads "libssl.so" at run time; it
// looks up SSL_get_peer_certificate, which OpenSSL 3 no longer exports (the name is a macro for
// SSL_get1_peer_certificate), leaves the pointer null and calls it on every TLS connection: a crash.
// This library carries the soname "libssl.so": loaded by the HTTP server before civetweb (see http.cc), it
// is what civetweb's dlopen("libssl.so") finds. It defines the missing function (1.1's version already
// returned a counted reference, as get1 does) and resolves everything else through its dependency on
// OpenSSL 3's libssl.
extern "C" {
void* SSL_get1_peer_certificate(const void* ssl);
__attribute__((visibility("default"))) void* SSL_get_peer_certificate(const void* ssl) {
  return SSL_get1_peer_certificate(ssl);
}
}
